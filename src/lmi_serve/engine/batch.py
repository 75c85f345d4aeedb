"""A batch of sequences being generated together: per-row Python state, the KV batch, the sampling history.

Three parts, row i of each being `rows[i]`: the `Row`s (request, detokenizer, stop state), the
`KVBatch` that runs the model (kv/protocol.py; by default in the engine's default layout, kv/select.py)
and the `SamplingHistory` (history.py: sampler, seen tokens, counts). Three verbs change the set of
rows, and each passes to every part: `Batch.prefill` (new rows), `filter` (rows leave) and
`concatenate` (two batches become one). The KV contract keeps a row's logits independent of its
neighbours, so a row's greedy output does not depend on the batch it runs in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lmi_serve.engine.detokenizer import IncrementalDetokenizer
from lmi_serve.engine.kv.protocol import KVBatch, KVLayout, Prefilled, eviction_order
from lmi_serve.engine.kv.select import layout_for
from lmi_serve.engine.sampling.grammar import Constraint
from lmi_serve.engine.sampling.history import SamplingHistory
from lmi_serve.engine.sampling.sampler import SampleOutput
from lmi_serve.engine.sampling.token_masks import token_mask
from lmi_serve.engine.sampling.watermark import Watermark, watermark_bias
from lmi_serve.engine.types import FinishReason, GenerationRequest, TokenEvent, TopToken


@dataclass
class Row:
    """Per-request Python state that lives alongside row i of the batch tensors."""

    request: GenerationRequest
    detokenizer: IncrementalDetokenizer
    token_text: Callable[[int], str]
    special_ids: frozenset[int]
    owner: Any = None  # whoever receives this row's events (the engine's RequestHandle)
    generated: int = 0
    finished: bool = False
    prompt_tokens: tuple[TopToken, ...] | None = None  # sent with the first event
    prompt_top_tokens: tuple[tuple[TopToken, ...], ...] | None = None  # sent with the first event
    constraint: Constraint | None = None  # the row's grammar, when its output is constrained
    token_ids: list[int] = field(default_factory=list)  # generated so far (banned sequences look back)
    watermark: Watermark | None = None  # the engine's watermark, when the request asks for one
    adapter_slot: int | None = None  # the LoRA slot its forwards use (engine/adapters.py); None: the base model
    cutoff: float | None = None  # monotonic time its generation deadline ends it (RequestHandle.cutoff)

    def advance(self, token_id: int, logprob: float, top: list[tuple[int, float]]) -> TokenEvent:
        """Account one chosen token: stop checks and detokenization, in that order."""
        self.generated += 1
        self.token_ids.append(token_id)
        stop = self.request.stop
        finish, cut = None, False
        if (token_id in stop.eos_token_ids and not stop.ignore_eos) or token_id in stop.stop_token_ids:
            finish, text = FinishReason.EOS_TOKEN, self.detokenizer.flush()
        else:
            if self.constraint is not None:
                try:
                    self.constraint.advance(token_id)
                except ValueError as exc:  # cannot happen under the mask; if it does, end this row only
                    self.finished = True
                    return TokenEvent(token_id, "", logprob, False, FinishReason.ERROR, error=str(exc))
            text, hit_stop = self.detokenizer.add(token_id, check_stops=self.generated > stop.min_new_tokens)
            if hit_stop:
                finish = FinishReason.STOP_SEQUENCE
            elif self.constraint is not None and self.constraint.complete:
                # The grammar allows nothing but the end: finish now instead of spending a step on EOS.
                finish = FinishReason.EOS_TOKEN
                text += self.detokenizer.flush()
            elif self.generated >= stop.max_new_tokens:
                finish = FinishReason.LENGTH
                text += self.detokenizer.flush()
            elif self.cutoff is not None and time.monotonic() >= self.cutoff:  # ends as at its token limit
                finish, cut = FinishReason.LENGTH, True
                text += self.detokenizer.flush()
        self.finished = finish is not None
        alternatives = tuple(TopToken(t, self.token_text(t), lp, t in self.special_ids) for t, lp in top)
        prompt, self.prompt_tokens = self.prompt_tokens, None
        prompt_top, self.prompt_top_tokens = self.prompt_top_tokens, None
        stop_string = self.detokenizer.stopped_by if finish is FinishReason.STOP_SEQUENCE else None
        return TokenEvent(token_id, text, logprob, token_id in self.special_ids, finish, alternatives, prompt,
                          prompt_top_tokens=prompt_top, stop_sequence=stop_string, deadline_cut=cut)


def make_row(request: GenerationRequest, tokenizer, owner: Any = None, constraint: Constraint | None = None,
             watermark: Watermark | None = None, adapter_slot: int | None = None) -> Row:
    options = request.detokenize
    detokenizer = IncrementalDetokenizer(tokenizer, request.stop.stop_sequences,
                                         request.stop.include_stop_str_in_output,
                                         skip_special_tokens=options.skip_special_tokens,
                                         spaces_between_special_tokens=options.spaces_between_special_tokens)
    return Row(request, detokenizer, lambda t: tokenizer.decode([t]), frozenset(tokenizer.all_special_ids), owner,
               constraint=constraint, watermark=watermark, adapter_slot=adapter_slot,
               cutoff=getattr(owner, "cutoff", None))


def _prompt_logprobs(logits: torch.Tensor, row: Row) -> None:
    """Set `row.prompt_tokens` from `logits` ([len(prompt), vocab]: every prompt position's): each
    prompt token's logprob and rank given the tokens before it (the first has neither), and with
    `prompt_top_n` each position's best alternatives."""
    ids = torch.tensor(row.request.prompt_ids, dtype=torch.long, device=logits.device)
    all_logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
    picked = all_logprobs.gather(1, ids[1:, None])
    ranks = [None, *((all_logprobs > picked).sum(dim=-1) + 1).tolist()]
    values = [None, *picked.squeeze(1).tolist()]
    row.prompt_tokens = tuple(TopToken(t, row.token_text(t), lp, t in row.special_ids, rank)
                              for t, lp, rank in zip(ids.tolist(), values, ranks))
    n = row.request.prompt_top_n
    if n:
        best, best_ids = torch.topk(all_logprobs, min(n, all_logprobs.shape[-1]), dim=-1)
        row.prompt_top_tokens = ((), *(
            tuple(TopToken(t, row.token_text(t), lp, t in row.special_ids, rank + 1)
                  for rank, (t, lp) in enumerate(zip(position_ids, position_lps)))
            for position_ids, position_lps in zip(best_ids.tolist(), best.tolist())))


@dataclass
class Batch:
    """Rows generated together: the Python rows, the KV batch that runs the model for them (kv/protocol.py)
    and their sampling history (history.py). Row i of each is the same request."""

    rows: list[Row]
    kv: KVBatch
    history: SamplingHistory
    logits: torch.Tensor | None = field(default=None, repr=False)  # of the last forward, not yet sampled

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def adapter_slots(self) -> list[int | None]:
        """Each row's LoRA slot, for `adapters.lora_rows` around this batch's forwards."""
        return [row.adapter_slot for row in self.rows]

    @classmethod
    def prefill(cls, model, rows: list[Row], pad_id: int, device, kv_layout: KVLayout | None = None
                ) -> "Batch":
        """One forward over the prompts of `rows` (by `kv_layout`, by default the model's default:
        kv/select.py); leaves logits ready to sample. A row with images is prefilled alone."""
        kv_layout = kv_layout or layout_for(model)
        requests = [r.request for r in rows]
        want_prompt = any(r.prompt_logprobs for r in requests)
        images = [r.images for r in requests if r.images is not None]
        if images and len(requests) > 1:  # prefill.py groups an image row alone; nothing else may batch it
            raise ValueError(f"a prompt with images is prefilled alone, not in a group of {len(requests)}")
        # Passed only with images: a layout that serves no vision model need not know the keyword.
        extra = {"model_inputs": images[0].named()} if images else {}
        out = kv_layout.prefill(model, [r.prompt_ids for r in requests], pad_id=pad_id, device=device,
                                prompt_logits=want_prompt, **extra)
        return cls.prefilled(rows, out, device)

    @classmethod
    def prefilled(cls, rows: list[Row], out: Prefilled, device) -> "Batch":
        """The batch of `rows` whose prompts `out` holds (a layout's prefill, or a chunked prefill's)."""
        for i, row in enumerate(rows):
            if row.request.prompt_logprobs:
                _prompt_logprobs(out.prompt_logits[i], row)
        history = SamplingHistory.start([r.request for r in rows], out.logits.shape[-1], device, out.seen)
        return cls(rows, out.kv, history, out.logits)

    def decode(self) -> None:
        """One forward feeding every row its pending token."""
        self.logits = self.kv.decode()

    def sample(self) -> SampleOutput:
        """Choose each row's next token from the last forward, record it and make it pending."""
        logits, self.logits = self.logits, None
        allowed = token_mask(self.rows, logits.shape[-1], logits.device)
        choice = self.history.choose(logits, allowed, watermark_bias(self.rows, logits.shape[-1], logits.device))
        self.history.record(choice.chosen)
        self.kv.feed(choice.chosen)  # still on the device: `emit` reads the ids as Python ints
        return choice

    def filter(self, keep: Sequence[int]) -> None:
        """Keep only the rows at `keep`, in that order."""
        if list(keep) == list(range(len(self.rows))):
            return
        self.rows = [self.rows[i] for i in keep]
        self.kv.keep(keep)
        self.history.keep(keep)

    def concatenate(self, other: "Batch") -> None:
        """Append `other`'s rows after this batch's."""
        self.rows += other.rows
        self.kv.extend(other.kv)
        self.history.extend(other.history)

    def emit(self, choice: SampleOutput) -> list[tuple[Row, TokenEvent]]:
        """Advance every row by its chosen token: the one Python loop over rows per step
        (stop checks, detokenization and event building together)."""
        return [(row, row.advance(token, logprob, top))
                for row, token, logprob, top in zip(self.rows, choice.token_ids, choice.logprobs, choice.top)]

    def evict_finished(self) -> None:
        """Drop the finished rows; the others go on in the order the KV batch moves least (a row's place
        in the batch means nothing: kv/protocol.py item 9)."""
        survivors = [i for i, row in enumerate(self.rows) if not row.finished]
        if len(survivors) < len(self.rows):
            self.filter(eviction_order(self.kv, survivors))
