"""N-gram speculation (engine/speculation.py): prompt lookup proposes the tokens that followed the
row's last n-gram; the KV layouts verify drafts in one forward and discard the rejected ones; and in
the engine a row generates exactly what it does without speculation (greedy, seeded, stop sequences,
token limits, grammars), with drafts accepted and counted."""

from __future__ import annotations

import pytest
import torch

from lmi_serve.engine.engine import Engine
from lmi_serve.engine.handle import RequestHandle
from lmi_serve.engine.kv.dynamic import DynamicKV
from lmi_serve.engine.kv.encdec import ENCODER_DECODER
from lmi_serve.engine.kv.protocol import KVLayout, Prefilled
from lmi_serve.engine.kv.select import KV_LAYOUTS
from lmi_serve.engine.kv.slots import SLOTS
from lmi_serve.engine.scheduler import Scheduler
from lmi_serve.engine.speculation import NgramSettings, NgramSpeculation, propose
from lmi_serve.engine.types import FinishReason, GenerationRequest, GuidedDecoding, SamplingParams, StopParams
from waiting import within

from engine_prompts import PROMPTS

CPU = torch.device("cpu")


# -- prompt lookup ---------------------------------------------------------------------------------

def test_propose_takes_what_followed_the_latest_earlier_occurrence_of_the_longest_ngram():
    settings = NgramSettings(length=3, longest=3, shortest=1)
    #            0  1  2  3  4  5  6  7  8  9 10 11
    sequence = [5, 6, 7, 1, 2, 5, 6, 7, 3, 4, 6, 7]
    # the tail 6 7 occurs at 1 and 6 (the latest: 6, followed by 3 4 6); 5 6 7 is not the tail
    assert propose(sequence, settings) == [3, 4, 6]
    assert propose([*sequence[:8], 9, 5, 6, 7], settings) == [9, 5, 6]  # 5 6 7 at 5 wins over 6 7 alone
    assert propose([1, 2, 3, 4], settings) == []  # no n-gram of the tail occurs earlier
    assert propose([7], settings) == []
    assert propose([1, 2, 1, 2], NgramSettings(length=5, longest=2, shortest=2)) == [1, 2]  # up to the end


def test_propose_never_uses_ngrams_shorter_than_the_shortest():
    sequence = [1, 2, 3, 9, 3]  # only the 1-gram "3" occurs earlier
    assert propose(sequence, NgramSettings(length=2, longest=3, shortest=1)) == [9, 3]
    assert propose(sequence, NgramSettings(length=2, longest=3, shortest=2)) == []


def test_settings_are_checked():
    with pytest.raises(ValueError):
        NgramSettings(length=0)
    with pytest.raises(ValueError):
        NgramSettings(longest=2, shortest=3)


def test_a_row_whose_drafts_keep_failing_pauses_longer_each_time_and_an_accepted_draft_ends_the_streak():
    speculation = NgramSpeculation(NgramSettings(length=2, longest=2, shortest=1))
    row, other = object(), object()
    prompt, generated = [1, 2, 3], [1]  # the tail 1 occurs earlier: drafts [2, 3]

    def skipped_after(accepted: int) -> int:
        """Record a verifying forward that took `accepted` drafts; then the steps that look up nothing."""
        speculation.record(2, accepted)
        skipped = 0
        while not speculation.drafts(row, prompt, generated):
            skipped += 1
        return skipped

    assert speculation.drafts(row, prompt, generated) == [2, 3]
    assert [skipped_after(0) for _ in range(7)] == [0, 1, 2, 4, 8, 16, 16]  # up to MAX_PAUSE
    assert skipped_after(1) == 0
    assert skipped_after(0) == 0  # one miss after a hit: no pause
    speculation.record(2, 0)  # a second: a pause starts ...
    assert speculation.drafts(other, prompt, generated) == [2, 3]  # ... which another row does not inherit


# -- the KV contract (kv/protocol.py item 10) -------------------------------------------------------

@pytest.fixture(autouse=True)
def prepared(tiny_model):
    SLOTS.prepare(tiny_model)


def fresh_logits(model, sequence) -> torch.Tensor:
    return DynamicKV.prefill(model, [sequence], pad_id=0, device=CPU).logits[0]


@pytest.mark.parametrize("kind", sorted(KV_LAYOUTS))
def test_verify_gives_each_positions_logits_and_discard_rewinds_the_row(kind, tiny_model, smollm2_tokenizer):
    layout = KV_LAYOUTS[kind]
    assert layout.supports_speculation
    prompt = list(smollm2_tokenizer.encode(PROMPTS[0], add_special_tokens=False))
    kv = layout.prefill(tiny_model, [prompt], pad_id=0, device=CPU).kv
    sequence = prompt + [11]
    kv.feed(torch.tensor([11]))
    drafts = [12, 13, 14]
    logits = kv.verify(drafts)
    assert logits.shape[0] == 1 + len(drafts)
    for position in range(len(drafts) + 1):  # each position's logits: those of its prefix, prefilled fresh
        expected = fresh_logits(tiny_model, sequence + drafts[:position])
        assert torch.allclose(logits[position], expected, atol=1e-4), position
    kv.discard(2)  # 13 and 14 were not chosen: the row holds its prompt, 11 and 12
    kv.feed(torch.tensor([21]))
    assert torch.allclose(kv.decode()[0], fresh_logits(tiny_model, sequence + [12, 21]), atol=1e-4)
    kv.feed(torch.tensor([22]))  # and it goes on decoding from there
    assert torch.allclose(kv.decode()[0], fresh_logits(tiny_model, sequence + [12, 21, 22]), atol=1e-4)


def test_verify_and_discard_refuse_more_than_one_row(tiny_model, prompt_ids):
    kv = SLOTS.prefill(tiny_model, [list(p) for p in prompt_ids[:2]], pad_id=0, device=CPU).kv
    kv.feed(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="one row"):
        kv.verify([3])
    with pytest.raises(ValueError):
        kv.discard(1)


def test_only_layouts_that_verify_drafts_take_speculation(tiny_model, smollm2_tokenizer):
    assert not ENCODER_DECODER.supports_speculation
    with pytest.raises(ValueError, match="verify draft tokens"):
        Scheduler(tiny_model, smollm2_tokenizer, CPU, max_batch_size=2, max_queue=2, kv_layout=ENCODER_DECODER,
                  speculation=NgramSpeculation(NgramSettings()))


# -- the scheduler's accept / reject rule, on a model that always says "last token + 1" ---------------

VOCAB = 64


class NextTokenKV:
    """One row whose logits after token t favour t + 1. It keeps what it cached as a list and checks, at
    every forward, that the pending token follows the last cached one: a draft left in the cache after it
    was rejected (or a chosen token discarded) breaks that."""

    def __init__(self, prompt):
        self.cached, self.pending = list(prompt), None

    @staticmethod
    def logits(tokens) -> torch.Tensor:
        out = torch.zeros((len(tokens), VOCAB))
        out[torch.arange(len(tokens)), (torch.tensor(tokens) + 1) % VOCAB] = 10.0
        return out

    def __len__(self) -> int:
        return 1

    def feed(self, tokens: torch.Tensor) -> None:
        self.pending = int(tokens[0])

    def _fed(self, tokens) -> torch.Tensor:
        assert tokens[0] == (self.cached[-1] + 1) % VOCAB, (self.cached, tokens)
        self.cached += tokens
        return self.logits(tokens)

    def decode(self) -> torch.Tensor:
        return self._fed([self.pending])

    def verify(self, drafts) -> torch.Tensor:
        return self._fed([self.pending, *drafts])

    def discard(self, tokens: int) -> None:
        del self.cached[len(self.cached) - tokens:]

    def keep(self, indices) -> None:
        assert list(indices) in ([], [0])


class NextTokenLayout(KVLayout):
    name = "next-token"
    supports_speculation = True

    def prefill(self, model, prompts, **kwargs) -> Prefilled:
        [prompt] = prompts
        kv = NextTokenKV(prompt)
        return Prefilled(kv, kv.logits(prompt[-1:]))


@pytest.mark.parametrize("prompt, drafts, accepted", [
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 50, 1, 2], 8, 5),  # 4, 5, 6, 7 all taken; then 9 taken, 50 not (10 is next)
    ([10, 11, 12, 13, 40, 41, 42, 10, 11], 4, 1),  # 13 taken, then 14, not 40
    ([30, 31, 32], 0, 0),  # nothing to look up
])
def test_drafts_are_taken_while_they_equal_the_choice_and_the_rest_leave_the_cache(
        prompt, drafts, accepted, smollm2_tokenizer):
    speculation = NgramSpeculation(NgramSettings(length=4, longest=3, shortest=2))
    scheduler = Scheduler(None, smollm2_tokenizer, CPU, max_batch_size=1, max_queue=1, kv_layout=NextTokenLayout(),
                          speculation=speculation)
    n = 12
    handle = RequestHandle(GenerationRequest(tuple(prompt), SamplingParams(),
                                             StopParams(max_new_tokens=n, ignore_eos=True)), deadline=None)
    scheduler.add(handle)
    steps = 0
    while not scheduler.idle:
        scheduler.step()
        steps += 1
    assert [e.token_id for e in handle.result().events] == [(prompt[-1] + 1 + i) % VOCAB for i in range(n)]
    stats = speculation.stats
    assert (stats.draft_tokens, stats.accepted_tokens) == (drafts, accepted)
    # one step per token not drafted, but the first step both prefills (the first token) and decodes
    assert steps == n - accepted - 1


# -- in the engine ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prompt_ids(smollm2_tokenizer):
    return [tuple(smollm2_tokenizer.encode(p, add_special_tokens=False)) for p in PROMPTS]


def request(prompt, n: int = 40, **sampling) -> GenerationRequest:
    return GenerationRequest(tuple(prompt), SamplingParams(**sampling), StopParams(max_new_tokens=n, ignore_eos=True))


def events(engine: Engine, requests) -> list[list[tuple[int, str, object]]]:
    results = within(lambda: engine.generate(requests).results())
    for result in results:
        assert result.error is None, result.error
    return [[(e.token_id, e.text, e.finish_reason) for e in r.events] for r in results]


@pytest.fixture(params=sorted(KV_LAYOUTS))
def engines(request, tiny_model, smollm2_tokenizer):
    """(without, with) speculation, on one KV layout."""
    def make(speculation):
        return Engine(tiny_model, smollm2_tokenizer, CPU, max_batch_size=4, kv_layout=KV_LAYOUTS[request.param],
                      speculation=speculation).start()
    plain, spec = make(None), make(NgramSpeculation(NgramSettings(length=4)))
    yield plain, spec
    plain.stop()
    spec.stop()


@pytest.fixture(scope="module")
def looping(prompt_ids):
    """A prompt after which the tiny random model falls into a loop of 7 tokens from its 9th: lookups hit there."""
    return prompt_ids[8]


def verified(spec: Engine, run) -> tuple[int, int]:
    """`run()`'s result, and the verifying forwards and accepted drafts it took."""
    before = spec.stats().speculation
    result = run()
    after = spec.stats().speculation
    return result, (after.steps - before.steps, after.accepted_tokens - before.accepted_tokens)


def test_a_row_generates_what_it_does_without_speculation_and_drafts_are_accepted(engines, prompt_ids, looping):
    plain, spec = engines
    expected = events(plain, [request(looping, 30)])
    tokens = [t for t, _, _ in expected[0]]
    assert tokens[8:15] == tokens[1:8]  # the premise: it loops
    got, (steps, accepted) = verified(spec, lambda: events(spec, [request(looping, 30)]))
    assert got == expected and steps > 0 and accepted > 0
    for prompt in prompt_ids:  # and whatever the prompt
        assert events(spec, [request(prompt)]) == events(plain, [request(prompt)])
    stats = spec.stats().speculation
    assert 0 < stats.accepted_tokens <= stats.draft_tokens
    assert spec.stats().steps < plain.stats().steps  # accepted drafts saved forwards
    assert plain.stats().speculation is None


def test_token_limits_and_stop_sequences_end_a_row_inside_its_accepted_drafts(engines, looping):
    plain, spec = engines
    for n in (1, 5, 11, 12, 13, 16):  # exactly n tokens, wherever the limit falls in a verified run
        expected = events(plain, [request(looping, n)])
        got, (steps, _) = verified(spec, lambda n=n: events(spec, [request(looping, n)]))
        assert got == expected and len(got[0]) == n
        assert steps > 0 or n <= 11  # the loop is found after 10 tokens, with room for drafts from 12 on
    text = [t for _, t, _ in events(plain, [request(looping, 30)])[0]]
    # Two tokens of the loop's second round, inside a verified run (the same text in the first round comes
    # before min_new_tokens, when stops are not looked for).
    stop = text[12] + text[13]
    stopped = GenerationRequest(looping, SamplingParams(), StopParams(max_new_tokens=30, ignore_eos=True,
                                                                     stop_sequences=(stop,), min_new_tokens=11))
    expected = events(plain, [stopped])
    got, (steps, accepted) = verified(spec, lambda: events(spec, [stopped]))
    assert got == expected and steps > 0 and accepted > 0
    assert got[0][-1][2] is FinishReason.STOP_SEQUENCE and len(got[0]) < 30


def test_seeded_sampling_and_grammars_choose_as_without_speculation(engines, looping, prompt_ids):
    plain, spec = engines
    accepted = 0
    # The tiny model's logits are near ties, so only some seeds at low temperatures follow its loop and
    # keep drafts (these do); at 0.7 none does. The draws are the same draws either way.
    for temperature, seed in ((0.01, 1), (0.001, 7), (0.7, 1), (0.7, 7)):
        sampled = request(looping, 24, do_sample=True, temperature=temperature, top_k=5, seed=seed)
        expected = events(plain, [sampled])
        got, (_, kept) = verified(spec, lambda: events(spec, [sampled]))
        assert got == expected, (temperature, seed)
        accepted += kept
    guided = GenerationRequest(prompt_ids[3], SamplingParams(), StopParams(max_new_tokens=24),
                               guided=GuidedDecoding(regex="(ab|abc){1,8}"))  # "ababc" repeated: drafts come
    expected = events(plain, [guided])
    got, (steps, _) = verified(spec, lambda: events(spec, [guided]))
    assert got == expected and steps > 0 and accepted > 0


def test_a_batch_of_several_rows_decodes_as_usual(engines, prompt_ids, looping):
    plain, spec = engines
    together = [request(p, 20) for p in (looping, *prompt_ids[:2])]
    got, (steps, _) = verified(spec, lambda: events(spec, together))
    assert got == events(plain, together)
    # admitted together, finishing together: the batch never shrank to one row, so no step verified drafts
    assert steps == 0
