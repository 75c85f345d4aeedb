"""The rolling batch end to end: Engine + Scheduler with a tiny random Llama on the CPU.

Central property: a request's greedy tokens do not depend on which requests ran beside it, joined
or left while it ran. Also: the batch bound, the waiting queue bound, cancellation, predict_timeout
and fault isolation. No timing assertions: waits are polls with generous timeouts.
"""

from __future__ import annotations

import time

import pytest
import torch

from lmi_serve.engine.engine import Engine
from lmi_serve.engine.handle import RequestHandle
from lmi_serve.engine.static_batch import generate_static_batch
from lmi_serve.engine.types import (
    FinishReason, GenerationRequest, GenerationResult, SamplingParams, StopParams,
)
from lmi_serve.errors import Overloaded, Timeout

from engine_prompts import PROMPTS as ALL_PROMPTS  # noqa: E402
from waiting import WAIT, within  # noqa: E402

CPU = torch.device("cpu")

PROMPTS = ALL_PROMPTS[:10]


@pytest.fixture(scope="module")
def prompt_ids(smollm2_tokenizer):
    return [tuple(smollm2_tokenizer.encode(p, add_special_tokens=False)) for p in PROMPTS]


def greedy(prompt, n=8) -> GenerationRequest:
    return GenerationRequest(tuple(prompt), SamplingParams(), StopParams(max_new_tokens=n, ignore_eos=True))


def alone(model, tok, request) -> list[int]:
    return [event.token_id for _, event in generate_static_batch(model, tok, CPU, [request])]


def result(handle: RequestHandle) -> GenerationResult:
    res = within(handle.result)
    evs = res.events
    assert evs and evs[-1].finish_reason is not None
    assert all(e.finish_reason is None for e in evs[:-1])
    return res


def ids_of(res: GenerationResult) -> list[int]:
    return [e.token_id for e in res.events]


def poll(condition, timeout: float = WAIT, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not reached within {timeout} s")
        time.sleep(0.01)


def idle(engine: Engine) -> bool:
    stats = engine.stats()
    return stats.running == 0 and stats.waiting == 0


@pytest.fixture
def make_engine(tiny_model, smollm2_tokenizer):
    engines: list[Engine] = []

    def make(model=None, *, start: bool = True, **kwargs) -> Engine:
        kwargs.setdefault("max_batch_size", 4)
        kwargs.setdefault("max_queue", 100)
        engine = Engine(model or tiny_model, smollm2_tokenizer, CPU, **kwargs)
        engines.append(engine)
        return engine.start() if start else engine

    yield make
    for engine in engines:
        if engine.alive:
            engine.stop()
            assert not engine.alive


class Wrapped:
    """The tiny model behind a hook that sees every forward's keyword arguments."""

    def __init__(self, model, hook):
        self.model, self.hook = model, hook
        self.config, self.generation_config = model.config, model.generation_config

    def __call__(self, **kwargs):
        self.hook(kwargs["input_ids"])
        return self.model(**kwargs)


# -- batch invariance while rows join and leave ------------------------------------------------


def test_staggered_requests_equal_each_run_alone(make_engine, tiny_model, smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    requests = [greedy(p, n) for p, n in zip(prompt_ids, [12, 3, 9, 15, 6, 1, 10, 4, 14, 7])]
    expected = [alone(tiny_model, tok, r) for r in requests]
    engine = make_engine(max_batch_size=4)
    streams = []
    for i, request in enumerate(requests):
        stream = iter(engine.submit(request))
        first = []
        if i % 3 == 2:  # wait for this one's first token: some rows start, some finish, before the next join
            first.append(within(lambda s=stream: next(s)))
        streams.append((stream, first))
    for i, (stream, first) in enumerate(streams):
        events = first + within(lambda s=stream: list(s))
        assert events[-1].finish_reason is FinishReason.LENGTH
        assert [e.token_id for e in events] == expected[i], f"request {i}"
    poll(lambda: idle(engine), what="idle engine")
    stats = engine.stats()
    assert stats.admitted == len(requests)
    assert 1 < stats.largest_batch <= 4
    assert stats.failed_steps == 0


@pytest.mark.parametrize("mixed", [False, True], ids=["separate", "mixed"])
def test_rows_joining_and_leaving_step_by_step(make_engine, tiny_model, smollm2_tokenizer, prompt_ids, mixed):
    """Deterministic rolling: the test drives Scheduler.step itself and submits between steps. With
    separate forwards a joiner is prefilled and then decoded in its first step (two tokens); in a mixed
    step its prompt rides in the decode forward (one token)."""
    tok = smollm2_tokenizer
    engine = make_engine(start=False, max_batch_size=3, mixed_steps=mixed)
    scheduler = engine.scheduler
    assert scheduler.mixed is mixed
    budgets = [6, 2, 9, 4, 7, 3, 5]
    requests = [greedy(prompt_ids[i], n) for i, n in enumerate(budgets)]
    expected = [alone(tiny_model, tok, r) for r in requests]
    handles, running = [], []

    def submit(*indexes):
        handles.extend(engine.submit(requests[i]) for i in indexes)

    submit(0)
    scheduler.step()
    running.append(scheduler.running)  # 0 alone
    submit(1, 2)
    scheduler.step()
    running.append(scheduler.running)  # 0, 1 and 2 join a running batch (1 ends at 2 tokens)
    submit(3, 4, 5)
    for _ in range(3):
        scheduler.step()
        running.append(scheduler.running)
        assert scheduler.running <= 3
    submit(6)
    for _ in range(40):
        if not scheduler.waiting and not scheduler.batch:
            break
        scheduler.step()
        assert scheduler.running <= 3
    assert running[:2] == ([1, 3] if mixed else [1, 2])  # mixed: 1 gets its second token a step later
    for i, handle in enumerate(handles):
        assert ids_of(result(handle)) == expected[i], f"request {i}"
        assert len(expected[i]) == budgets[i]
    assert scheduler.stats.largest_batch == 3
    assert scheduler.stats.admitted == len(requests)
    assert scheduler.stats.prefills >= 4


def test_batch_never_exceeds_max_batch_size_and_waiting_requests_finish(make_engine, tiny_model, smollm2_tokenizer,
                                                                        prompt_ids):
    engine = make_engine(start=False, max_batch_size=2)
    requests = [greedy(p, n) for p, n in zip(prompt_ids, [5, 8, 3, 6, 4, 7])]
    handles = [engine.submit(r) for r in requests]
    assert engine.stats().waiting == 6 and engine.stats().running == 0
    engine.start()
    for request, handle in zip(requests, handles):
        res = result(handle)
        assert res.finish_reason is FinishReason.LENGTH
        assert ids_of(res) == alone(tiny_model, smollm2_tokenizer, request)
    poll(lambda: idle(engine), what="idle engine")
    stats = engine.stats()
    assert stats.largest_batch == stats.max_batch_size == 2
    assert stats.admitted == 6


def test_queue_overflow_raises_overloaded(make_engine, prompt_ids):
    engine = make_engine(start=False, max_batch_size=1, max_queue=2)
    first, second = engine.submit(greedy(prompt_ids[0], 3)), engine.submit(greedy(prompt_ids[1], 3))
    with pytest.raises(Overloaded):
        engine.submit(greedy(prompt_ids[2], 3))
    assert engine.stats().waiting == 2
    engine.start()
    assert result(first).generated_tokens == 3
    assert result(second).generated_tokens == 3
    poll(lambda: idle(engine), what="idle engine")
    # Room again once the queue drained.
    assert result(engine.submit(greedy(prompt_ids[2], 2))).generated_tokens == 2


# -- cancellation and timeouts -----------------------------------------------------------------


def test_cancelled_running_request_is_evicted(make_engine, tiny_model, smollm2_tokenizer, prompt_ids):
    engine = make_engine(max_batch_size=4)
    endless = engine.submit(greedy(prompt_ids[2], 100_000))  # only cancellation ends it in time
    within(lambda: next(iter(endless)))
    others = [greedy(prompt_ids[i], 6) for i in (0, 3, 5)]
    handles = [engine.submit(r) for r in others]
    within(lambda: next(iter(handles[0])))
    endless.cancel()
    events = within(lambda: list(endless))  # the stream ends: a reader left behind is not stuck
    assert events[-1].finish_reason is FinishReason.CANCELLED and events[-1].token_id == -1
    rest = [result(h) for h in handles[1:]]
    for request, res in zip(others[1:], rest):
        assert ids_of(res) == alone(tiny_model, smollm2_tokenizer, request)
    poll(lambda: idle(engine), what="running count back to 0 after cancel")
    # The engine keeps serving.
    assert ids_of(result(engine.submit(others[0]))) == alone(tiny_model, smollm2_tokenizer, others[0])


def test_cancelled_waiting_request_is_never_admitted(make_engine, prompt_ids):
    engine = make_engine(start=False, max_batch_size=1)
    first = engine.submit(greedy(prompt_ids[0], 4))
    dropped = engine.submit(greedy(prompt_ids[1], 4))
    last = engine.submit(greedy(prompt_ids[3], 4))
    dropped.cancel()
    engine.start()
    assert [e.finish_reason for e in within(lambda: list(dropped))] == [FinishReason.CANCELLED]
    assert result(first).generated_tokens == 4
    assert result(last).generated_tokens == 4
    poll(lambda: idle(engine), what="idle engine")
    assert engine.stats().admitted == 2


def test_request_waiting_past_predict_timeout_ends_with_a_timeout_event(make_engine, tiny_model, smollm2_tokenizer, prompt_ids):
    engine = make_engine(max_batch_size=1)
    engine.predict_timeout = None  # the request holding the only row has no deadline
    blocker = engine.submit(greedy(prompt_ids[2], 100_000))
    within(lambda: next(iter(blocker)))
    engine.predict_timeout = 0.2
    late = engine.submit(greedy(prompt_ids[0], 3))
    (ended,) = within(lambda: list(late))  # the timeout is the request's one terminal event, of its kind
    assert ended.finish_reason is FinishReason.ERROR and "predict_timeout" in ended.error
    with pytest.raises(Timeout):
        ended.raise_failure()
    assert engine.stats().waiting == 0
    blocker.cancel()
    poll(lambda: idle(engine), what="idle engine")
    engine.predict_timeout = WAIT
    request = greedy(prompt_ids[0], 3)
    assert ids_of(result(engine.submit(request))) == alone(tiny_model, smollm2_tokenizer, request)


def test_generation_deadline_ends_a_running_request_with_its_greedy_tokens_so_far(make_engine, tiny_model,
                                                                                   smollm2_tokenizer, prompt_ids):
    engine = make_engine(generation_deadline=0.3)
    cut = result(engine.submit(greedy(prompt_ids[1], 100_000)))
    last = cut.events[-1]
    assert last.finish_reason is FinishReason.LENGTH and last.deadline_cut and cut.deadline_cut
    assert last.token_id >= 0 and 0 < cut.generated_tokens < 100_000  # it ends on a real token, as at its limit
    assert ids_of(cut) == alone(tiny_model, smollm2_tokenizer, greedy(prompt_ids[1], cut.generated_tokens))
    assert not any(event.deadline_cut for event in cut.events[:-1])
    limited = result(engine.submit(greedy(prompt_ids[1], 2)))  # ended by its limit before the deadline
    assert limited.finish_reason is FinishReason.LENGTH and not limited.deadline_cut


def test_generation_deadline_ends_a_waiting_request_with_nothing(make_engine, prompt_ids):
    engine = make_engine(max_batch_size=1)
    blocker = engine.submit(greedy(prompt_ids[2], 100_000))  # no deadline: it holds the only row
    within(lambda: next(iter(blocker)))
    engine.generation_deadline = 0.2
    late = engine.submit(greedy(prompt_ids[0], 3))
    (ended,) = within(lambda: list(late))  # its one event: no token, LENGTH, cut by the deadline
    assert (ended.token_id, ended.text, ended.finish_reason, ended.deadline_cut) == (-1, "", FinishReason.LENGTH, True)
    assert ended.error is None and engine.stats().waiting == 0
    blocker.cancel()
    poll(lambda: idle(engine), what="idle engine")


# -- fault isolation ---------------------------------------------------------------------------


def assert_failure(res: GenerationResult, tokens_before: list[int]) -> None:
    *good, last = res.events
    assert [e.token_id for e in good] == tokens_before
    assert last.token_id == -1
    assert last.finish_reason is FinishReason.ERROR
    assert last.error and "poisoned" in last.error
    assert res.error == last.error


def test_failed_prefill_fails_only_the_poisoned_request(make_engine, tiny_model, smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    poison = tok.encode(" zebra", add_special_tokens=False)[0]
    assert all(poison not in p for p in prompt_ids), "test premise: only the poisoned prompt has the token"

    def hook(input_ids):
        if input_ids.shape[1] > 1 and bool((input_ids == poison).any()):
            raise RuntimeError("poisoned prompt")

    engine = make_engine(Wrapped(tiny_model, hook), start=False, max_batch_size=4)
    good = [greedy(prompt_ids[i], 6) for i in (1, 4, 3)]
    poisoned = greedy((*prompt_ids[2], poison, *prompt_ids[0]), 6)
    # Submitted before the engine starts: all four are prefilled together in the first step.
    handles = [engine.submit(good[0]), engine.submit(poisoned), engine.submit(good[1]), engine.submit(good[2])]
    engine.start()
    results = [result(h) for h in handles]
    assert_failure(results[1], [])
    for request, res in zip(good, [results[0], results[2], results[3]]):
        assert ids_of(res) == alone(tiny_model, tok, request)
        assert res.finish_reason is FinishReason.LENGTH and res.error is None
    poll(lambda: idle(engine), what="idle engine")
    assert engine.stats().failed_steps >= 1  # a joint prefill (if grouped), then the poisoned one alone
    assert engine.stats().admitted == 3

    # Later requests still work, poisoned ones still fail alone.
    later = [engine.submit(good[2]), engine.submit(poisoned)]
    assert ids_of(result(later[0])) == alone(tiny_model, tok, good[2])
    assert_failure(result(later[1]), [])
    assert engine.alive


def test_failed_decode_fails_the_running_requests_and_the_engine_goes_on(make_engine, tiny_model,
                                                                         smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    decodes = {"count": 0, "fail_at": 3}

    def hook(input_ids):
        if input_ids.shape[1] == 1:
            decodes["count"] += 1
            if decodes["count"] == decodes["fail_at"]:
                raise RuntimeError("poisoned decode step")

    assert all(len(p) > 1 for p in prompt_ids[1:5]), "test premise: a prefill feeds more than one token"
    engine = make_engine(Wrapped(tiny_model, hook), start=False, max_batch_size=2)
    requests = [greedy(prompt_ids[i], 10) for i in (1, 2, 3)]
    handles = [engine.submit(r) for r in requests]  # the third waits for a free row
    engine.start()
    # Rows 0 and 1: a prefill token and two decode tokens, then the third decode raises.
    for request, handle in zip(requests[:2], handles[:2]):
        assert_failure(result(handle), alone(tiny_model, tok, request)[:3])
    # The waiting request is admitted into the freed rows and runs normally.
    assert ids_of(result(handles[2])) == alone(tiny_model, tok, requests[2])
    poll(lambda: idle(engine), what="idle engine")
    assert engine.stats().failed_steps == 1
    # And new requests keep working.
    request = greedy(prompt_ids[4], 5)
    assert ids_of(result(engine.submit(request))) == alone(tiny_model, tok, request)
    assert engine.alive


# -- stats -------------------------------------------------------------------------------------


def test_stats_running_reads_the_batch_once(make_engine):
    """stats() runs on request threads while the scheduler thread may drop the batch between two
    reads of `scheduler.batch`; `running` must not read it twice."""
    engine = make_engine(start=False)
    scheduler = engine.scheduler

    class Vanishing:
        def __len__(self):
            scheduler.batch = None  # the scheduler evicts the last row right after the first read
            return 1

    scheduler.batch = Vanishing()
    assert engine.stats().running in (0, 1)


def test_an_idle_engine_counts_no_steps(make_engine, prompt_ids):
    """`steps` counts steps that ran work: the loop's wake-ups with nothing to do are not steps."""
    engine = make_engine(start=False)
    wake_ups = []
    wait = engine.scheduler.wait_for_work

    def counted(timeout: float) -> None:
        wait(timeout)
        wake_ups.append(timeout)

    engine.scheduler.wait_for_work = counted
    engine.start()
    result(engine.submit(greedy(prompt_ids[0], n=5)))
    poll(lambda: idle(engine), what="the request's row evicted")
    woken = len(wake_ups)
    poll(lambda: len(wake_ups) > woken, what="the loop back from its last step")
    woken = len(wake_ups)
    assert engine.stats().steps == 4  # 5 tokens: the first step prefills and decodes, then one per step
    poll(lambda: len(wake_ups) >= woken + 3, what="three idle wake-ups")
    assert engine.stats().steps == 4
