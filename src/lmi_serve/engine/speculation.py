"""N-gram speculation (`option.draft_model_id=ngram`): guess a row's next tokens from its own text, and
check the guesses in one forward instead of one forward each.

At one row a decode step reads every weight to compute one token; reading them for a handful of
tokens costs little more (the step is bound by the weights' bytes, not by arithmetic). Prompt
lookup finds the row's last n tokens (n from `longest` down to `shortest`) earlier in its prompt or
output and proposes the `length` tokens that followed them there: text that quotes, edits or
summarises its prompt repeats it. The scheduler (decode.py `Decode._verify`) feeds the pending token
and the drafts in one forward (the KV layout's `verify`, kv/protocol.py item 10), then chooses the
tokens one position at a time exactly as a decode step would (the same sampler, masks, penalties,
grammar and stop checks, each seeing the tokens chosen before it), accepting drafts while the chosen
token equals the draft; the first choice that differs is the row's next pending token and the
drafts after it are discarded from the cache. So the output is what decoding one token a step
gives, sampled rows included (a sampled token is accepted only when it equals the draft; no
rejection sampling), with one caveat the docs state: the logits come from a forward over several
positions, which rounds differently from a one-token forward (~1e-6 in fp32), as a batch does.

Only a batch of one row speculates: rows of a batch accept different numbers of drafts, and the
left-padded layouts keep one column cursor for all rows. A verifying forward costs more than a
one-token one (~10 % for 4 drafts at one row here), so where guesses keep failing (text that does not repeat
itself, whose short n-grams still recur) the row stops looking for a while: after a second forward in
a row that accepted nothing it skips 1 step, after a third 2, then 4 ... up to MAX_PAUSE; any accepted
draft ends the streak (one miss among hits, as in a summary that quotes, costs no pause).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lmi_serve.config.models import DEFAULT_SPEC_LENGTH

MAX_PAUSE = 16  # decode steps a row skips looking up drafts after its guesses kept failing, at most


@dataclass(frozen=True)
class NgramSettings:
    length: int = DEFAULT_SPEC_LENGTH  # draft tokens proposed per step, at most
    longest: int = 4  # the n-gram sizes looked up, longest first
    shortest: int = 2

    def __post_init__(self) -> None:
        if self.length < 1 or not 1 <= self.shortest <= self.longest:
            raise ValueError(f"invalid n-gram speculation settings: {self}")


def propose(sequence: Sequence[int], settings: NgramSettings) -> list[int]:
    """Up to `settings.length` tokens that followed the latest earlier occurrence of `sequence`'s last
    n tokens, for the longest n (from `longest` down to `shortest`) that occurs earlier; [] when none does."""
    tokens = np.asarray(sequence, dtype=np.int64)
    for n in range(settings.longest, settings.shortest - 1, -1):
        if len(tokens) <= n:
            continue
        # windows starting at 0 .. len - n - 1: each occurrence before the tail has a token after it
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + settings.length].tolist()
    return []


@dataclass
class SpeculationStats:
    """Cumulative counts (the scheduler thread writes them; metrics read them)."""

    steps: int = 0  # forwards that verified drafts
    draft_tokens: int = 0  # drafts proposed and fed
    accepted_tokens: int = 0  # drafts the engine chose


class NgramSpeculation:
    """What the scheduler asks: the drafts for a row, and the counts of what came of them."""

    def __init__(self, settings: NgramSettings):
        self.settings = settings
        self.stats = SpeculationStats()
        # The row that speculates now (only a batch of one row does; its id), its forwards in a row that
        # accepted nothing, and the steps left in its pause.
        self._row, self._misses, self._skip = None, 0, 0

    def drafts(self, row: object, prompt_ids: Sequence[int], generated: Sequence[int]) -> list[int]:
        """Draft tokens to follow `generated` (whose last token is `row`'s pending one); none while the
        row pauses."""
        if id(row) != self._row:
            self._row, self._misses, self._skip = id(row), 0, 0
        if self._skip:
            self._skip -= 1
            return []
        if not generated:
            return []
        return propose([*prompt_ids, *generated], self.settings)

    def record(self, proposed: int, accepted: int) -> None:
        """What came of the drafts `drafts` gave last; the second forward in a row that accepted none starts a
        pause, each further one a longer pause."""
        self.stats.steps += 1
        self.stats.draft_tokens += proposed
        self.stats.accepted_tokens += accepted
        self._misses = 0 if accepted else self._misses + 1
        self._skip = min(2 ** (self._misses - 2), MAX_PAUSE) if self._misses >= 2 else 0

    def describe(self) -> str:
        s = self.settings
        return (f"n-gram speculation on: up to {s.length} draft tokens a step from the row's last "
                f"{s.shortest}-{s.longest} tokens found earlier in its text (batches of one row)")
