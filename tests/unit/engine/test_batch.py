"""Batch verbs with a tiny random Llama and the real SmolLM2 tokenizer.

The central property: `concatenate` and `filter` (with its padding trim) are invisible to each
row, so a row joining or leaving a running batch does not change what any row generates.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from lmi_serve.engine.batch import Batch, make_row
from lmi_serve.engine.kv.dynamic import DYNAMIC
from lmi_serve.engine.static_batch import generate_static_batch
from lmi_serve.engine.types import FinishReason, GenerationRequest, SamplingParams, StopParams, TokenEvent

from engine_prompts import PROMPTS as ALL_PROMPTS  # noqa: E402

CPU = torch.device("cpu")

PROMPTS = ALL_PROMPTS[:5]


def greedy(prompt, n=8, **kwargs) -> GenerationRequest:
    stop = {k: kwargs.pop(k) for k in list(kwargs) if k in StopParams.__dataclass_fields__}
    stop.setdefault("ignore_eos", True)
    return GenerationRequest(tuple(prompt), SamplingParams(), StopParams(max_new_tokens=n, **stop), **kwargs)


def alone(model, tok, request) -> list[TokenEvent]:
    return [event for _, event in generate_static_batch(model, tok, CPU, [request])]


def ids_of(events) -> list[int]:
    return [e.token_id for e in events]


class Runner:
    """Drives Batches the way the scheduler does, collecting events per owner. Its batches are in the
    dynamic layout (kv/dynamic.py), whose cache tensors `check` reads."""

    def __init__(self, model, tok):
        self.model, self.tok = model, tok
        self.events: dict[object, list[TokenEvent]] = defaultdict(list)

    def prefill(self, requests: dict) -> Batch:
        rows = [make_row(request, self.tok, owner=owner) for owner, request in requests.items()]
        batch = Batch.prefill(self.model, rows, self.tok.pad_token_id, CPU, DYNAMIC)
        self._emit(batch)
        return batch

    def step(self, batch: Batch) -> None:
        batch.decode()
        self._emit(batch)

    def _emit(self, batch: Batch) -> None:
        for row, event in batch.emit(batch.sample()):
            assert not (self.events[row.owner] and self.events[row.owner][-1].finish_reason), \
                f"{row.owner} got an event after its finishing event"
            self.events[row.owner].append(event)
        batch.evict_finished()
        self.check(batch)

    @staticmethod
    def check(batch: Batch) -> None:
        """The invariants that tie the tensors to the rows."""
        kv, history = batch.kv, batch.history
        n, width = len(batch), kv.mask.shape[1]
        assert len(kv) == kv.mask.shape[0] == kv.next_pos.shape[0] == kv.pending.shape[0] == n
        assert history.seen.shape[0] == history.counts.shape[0] == len(history.sampler.params) == n
        for layer in kv.cache.layers:
            assert layer.keys.shape[0] == layer.values.shape[0] == n
            assert layer.keys.shape[2] == layer.values.shape[2] == width
        if n:
            # The pending token's position is the number of real tokens already cached.
            assert kv.next_pos.tolist() == kv.mask.sum(dim=1).tolist()
            assert bool(kv.mask.any(dim=0)[0]), "a leading column is padding in every row"

    def finish(self, batch: Batch, limit: int = 100) -> None:
        for _ in range(limit):
            if not len(batch):
                return
            self.step(batch)
        raise AssertionError("batch did not finish")


def assert_same(got: list[TokenEvent], expected: list[TokenEvent]) -> None:
    assert ids_of(got) == ids_of(expected)
    assert [e.logprob for e in got] == pytest.approx([e.logprob for e in expected], abs=1e-4)
    assert "".join(e.text for e in got) == "".join(e.text for e in expected)
    assert got[-1].finish_reason is expected[-1].finish_reason


@pytest.mark.parametrize("older, older_steps", [("short", 2), ("long", 4)],
                         ids=["running-cache-shorter", "running-cache-longer"])
def test_concatenate_of_prefilled_batches_is_invisible(tiny_model, smollm2_tokenizer, prompt_ids, older,
                                                        older_steps):
    tok = smollm2_tokenizer
    sampled = SamplingParams(do_sample=True, seed=7, temperature=1.0)
    requests = {
        "short": greedy(prompt_ids[0], 12),
        "mid": GenerationRequest(prompt_ids[1], SamplingParams(repetition_penalty=1.5),
                                 StopParams(max_new_tokens=10, ignore_eos=True)),
        "long": greedy(prompt_ids[4], 10),
        "seeded": GenerationRequest(prompt_ids[3], sampled, StopParams(max_new_tokens=10, ignore_eos=True)),
        "presence": GenerationRequest(prompt_ids[2], SamplingParams(presence_penalty=1.0, frequency_penalty=0.5),
                                      StopParams(max_new_tokens=10, ignore_eos=True)),
    }
    reference = {k: alone(tiny_model, tok, r) for k, r in requests.items()}

    run = Runner(tiny_model, tok)
    running = run.prefill({older: requests[older]})
    for _ in range(older_steps):
        run.step(running)
    joining = [k for k in requests if k != older]
    joiners = run.prefill({k: requests[k] for k in joining})
    if older == "long":
        assert running.kv.mask.shape[1] > joiners.kv.mask.shape[1], "test premise: the running cache is longer"
    else:
        assert running.kv.mask.shape[1] < joiners.kv.mask.shape[1], "test premise: the joiners' cache is longer"
    running.concatenate(joiners)
    run.check(running)
    assert [row.owner for row in running.rows] == [older, *joining]
    run.finish(running)

    for key, expected in reference.items():
        assert_same(run.events[key], expected)


def test_concatenate_twice_and_into_a_batch_that_already_lost_rows(tiny_model, smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    requests = {i: greedy(p, n) for i, (p, n) in enumerate(zip(prompt_ids, [3, 9, 6, 12, 7]))}
    reference = {k: alone(tiny_model, tok, r) for k, r in requests.items()}
    run = Runner(tiny_model, tok)
    batch = run.prefill({4: requests[4], 0: requests[0]})
    run.step(batch)
    batch.concatenate(run.prefill({1: requests[1]}))
    run.check(batch)
    for _ in range(3):
        run.step(batch)
    assert [row.owner for row in batch.rows] == [4, 1]  # 0 left after 3 tokens
    batch.concatenate(run.prefill({3: requests[3], 2: requests[2]}))
    run.check(batch)
    run.finish(batch)
    for key, expected in reference.items():
        assert_same(run.events[key], expected)


def test_filter_after_some_steps_trims_padding_and_keeps_outputs(tiny_model, smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    requests = {i: greedy(p, 10) for i, p in enumerate(prompt_ids)}
    reference = {k: alone(tiny_model, tok, r) for k, r in requests.items()}
    run = Runner(tiny_model, tok)
    batch = run.prefill(requests)
    for _ in range(3):
        run.step(batch)
    width = batch.kv.mask.shape[1]
    # Drop the longest prompt (4) and one more: the leading columns were padding for all the others.
    batch.filter([0, 1, 3])
    run.check(batch)
    trimmed = width - batch.kv.mask.shape[1]
    longest_left = max(len(prompt_ids[i]) for i in (0, 1, 3))
    assert trimmed == len(prompt_ids[4]) - longest_left, "padding nobody needs must be trimmed"
    assert [row.owner for row in batch.rows] == [0, 1, 3]
    run.finish(batch)
    for key in (0, 1, 3):
        assert_same(run.events[key], reference[key])
    for key in (2, 4):  # the dropped rows stopped where they were
        assert ids_of(run.events[key]) == ids_of(reference[key])[:4]


class Steered:
    """The tiny model with a fixed bias on a few favourite tokens: greedy keeps picking them, so
    repetition / presence / frequency penalties decide what comes next."""

    FAVOURITES = (1000, 2000, 3000, 4000, 5000)

    def __init__(self, model):
        self.model, self.config = model, model.config
        self.bias = torch.zeros(model.config.vocab_size)
        self.bias[list(self.FAVOURITES)] = torch.tensor([8.0, 7.3, 6.9, 6.2, 5.1])

    def __call__(self, **kwargs):
        return SimpleNamespace(logits=self.model(**kwargs).logits + self.bias)


def test_penalty_history_follows_rows_through_concatenate_and_filter(tiny_model, smollm2_tokenizer, prompt_ids):
    tok, model = smollm2_tokenizer, Steered(tiny_model)
    fav = Steered.FAVOURITES

    def request(prompt, n, **sampling):
        return GenerationRequest(tuple(prompt), SamplingParams(**sampling),
                                 StopParams(max_new_tokens=n, ignore_eos=True))

    requests = {
        "repetition": request((*prompt_ids[1], fav[2]), 8, repetition_penalty=1.5),  # a favourite in the prompt
        "plain": request(prompt_ids[4], 6),
        "presence": request(prompt_ids[2], 10, presence_penalty=1.0, frequency_penalty=0.4),
        "both": request((*prompt_ids[3], fav[0]), 9, repetition_penalty=1.3, presence_penalty=0.5),
    }
    reference = {k: alone(model, tok, r) for k, r in requests.items()}
    assert set(ids_of(reference["plain"])) == {fav[0]}
    for key in ("repetition", "presence", "both"):
        assert len(set(ids_of(reference[key]))) > 2, f"test premise: the penalties steer {key}"
    assert ids_of(reference["repetition"]) != ids_of(alone(model, tok, request(prompt_ids[1], 8,
                                                                               repetition_penalty=1.5))), \
        "test premise: the prompt's favourite is penalised"

    run = Runner(model, tok)
    batch = run.prefill({k: requests[k] for k in ("repetition", "plain")})
    for _ in range(2):
        run.step(batch)
    batch.concatenate(run.prefill({k: requests[k] for k in ("presence", "both")}))
    run.check(batch)
    for _ in range(2):
        run.step(batch)
    batch.filter([0, 2, 3])  # "plain" leaves early
    run.check(batch)
    run.finish(batch)
    for key in ("repetition", "presence", "both"):
        assert_same(run.events[key], reference[key])
    assert ids_of(run.events["plain"]) == ids_of(reference["plain"])[:5]


def test_filter_keeping_every_row_is_a_no_op_and_to_nothing_is_empty(tiny_model, smollm2_tokenizer, prompt_ids):
    run = Runner(tiny_model, smollm2_tokenizer)
    batch = run.prefill({0: greedy(prompt_ids[0]), 1: greedy(prompt_ids[2])})
    mask = batch.kv.mask
    batch.filter([0, 1])
    assert batch.kv.mask is mask
    batch.filter([])
    assert len(batch) == 0
    run.check(batch)


def test_prompt_logprobs_match_a_plain_forward(tiny_model, smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    requests = {
        "short": greedy(prompt_ids[1], 3, prompt_logprobs=True),
        "long": greedy(prompt_ids[4], 3),  # pads the others on the left
        "mid": greedy(prompt_ids[2], 3, prompt_logprobs=True),
    }
    run = Runner(tiny_model, tok)
    run.finish(run.prefill(requests))

    assert run.events["long"][0].prompt_tokens is None
    for key in ("short", "mid"):
        prompt = list(requests[key].prompt_ids)
        first, *rest = run.events[key]
        assert all(e.prompt_tokens is None for e in rest)
        tokens = first.prompt_tokens
        assert tokens is not None and len(tokens) == len(prompt)
        assert [t.token_id for t in tokens] == prompt
        assert [t.text for t in tokens] == [tok.decode([t]) for t in prompt]
        assert tokens[0].logprob is None
        with torch.inference_mode():
            logp = torch.log_softmax(tiny_model(input_ids=torch.tensor([prompt])).logits[0].float(), dim=-1)
        expected = [logp[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
        assert [t.logprob for t in tokens[1:]] == pytest.approx(expected, abs=1e-4)
        # The first generated token is the argmax of the last position, with its logprob.
        assert first.token_id == int(logp[-1].argmax())
        assert first.logprob == pytest.approx(logp[-1].max().item(), abs=1e-4)
        # Prompt logprobs change nothing about the generation.
        assert ids_of(run.events[key]) == ids_of(alone(tiny_model, tok, greedy(prompt, 3)))


def test_prompt_logprobs_marks_special_tokens(tiny_model, smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=False)
    run = Runner(tiny_model, tok)
    run.finish(run.prefill({0: greedy(prompt, 1, prompt_logprobs=True)}))
    tokens = run.events[0][0].prompt_tokens
    special = set(tok.all_special_ids)
    assert [t.special for t in tokens] == [t in special for t in prompt]
    assert any(t.special for t in tokens)


def test_top_n_tokens_are_reported_with_text(tiny_model, smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    requests = {"top3": greedy(prompt_ids[2], 5, top_n_tokens=3), "none": greedy(prompt_ids[0], 5),
                "top1": greedy(prompt_ids[4], 5, top_n_tokens=1)}
    run = Runner(tiny_model, tok)
    run.finish(run.prefill(requests))
    assert all(e.top_tokens == () for e in run.events["none"])
    for key, n in (("top3", 3), ("top1", 1)):
        for event in run.events[key]:
            assert len(event.top_tokens) == n
            assert [t.text for t in event.top_tokens] == [tok.decode([t.token_id]) for t in event.top_tokens]
            values = [t.logprob for t in event.top_tokens]
            assert values == sorted(values, reverse=True)
            # Greedy: the chosen token is the best alternative.
            assert event.top_tokens[0].token_id == event.token_id
            assert event.top_tokens[0].logprob == pytest.approx(event.logprob)
        # Alternatives change nothing about the generation.
        assert ids_of(run.events[key]) == ids_of(alone(tiny_model, tok, greedy(requests[key].prompt_ids, 5)))


def test_stop_token_ids_end_a_row_with_eos_token(tiny_model, smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    prompt = prompt_ids[3]
    free = ids_of(alone(tiny_model, tok, greedy(prompt, 8)))
    k = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    stopper = frozenset({free[k]})
    requests = {
        # stop_token_ids end the row even with ignore_eos (which is about the model's EOS only).
        "stop": greedy(prompt, 8, stop_token_ids=stopper, ignore_eos=True),
        "other": greedy(prompt_ids[1], 8),
    }
    run = Runner(tiny_model, tok)
    run.finish(run.prefill(requests))
    stopped = run.events["stop"]
    assert ids_of(stopped) == free[:k + 1]
    assert stopped[-1].finish_reason is FinishReason.EOS_TOKEN
    assert all(e.finish_reason is None for e in stopped[:-1])
    assert "".join(e.text for e in stopped) == tok.decode(free[:k], skip_special_tokens=True)
    assert len(run.events["other"]) == 8 and run.events["other"][-1].finish_reason is FinishReason.LENGTH


def test_prompt_tokens_carry_ranks_and_requested_alternatives(tiny_model, smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    prompt = list(prompt_ids[2])
    run = Runner(tiny_model, tok)
    run.finish(run.prefill({"top": greedy(prompt, 1, prompt_logprobs=True, prompt_top_n=3),
                            "plain": greedy(prompt_ids[4], 1, prompt_logprobs=True)}))
    with torch.inference_mode():
        logp = torch.log_softmax(tiny_model(input_ids=torch.tensor([prompt])).logits[0].float(), dim=-1)
    first = run.events["top"][0]
    assert first.prompt_tokens[0].rank is None
    # A random model's logprobs lie close together: the batched (padded) forward may differ from this
    # plain one in the last digits, so a rank is checked against the counts just below and above.
    for i, token in enumerate(first.prompt_tokens[1:], start=1):
        value = logp[i - 1, prompt[i]]
        assert int((logp[i - 1] > value + 1e-4).sum()) + 1 <= token.rank <= int((logp[i - 1] > value - 1e-4).sum()) + 1
    alternatives = first.prompt_top_tokens
    assert len(alternatives) == len(prompt) and alternatives[0] == ()
    for i, best in enumerate(alternatives[1:], start=1):
        assert [t.rank for t in best] == [1, 2, 3]
        assert [t.logprob for t in best] == pytest.approx(torch.topk(logp[i - 1], 3).values.tolist(), abs=1e-4)
        assert [logp[i - 1, t.token_id].item() for t in best] == pytest.approx([t.logprob for t in best], abs=1e-4)
    assert run.events["plain"][0].prompt_top_tokens is None
