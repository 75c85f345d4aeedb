"""Beam search inside the rolling batch (engine/beams/rows.py): the same beams as transformers'
`generate(num_beams=k)` (beam_reference.py, the oracle), stepped one token per scheduler step beside
the ordinary rows, counted against max_batch_size, cancellable within a step, failing alone."""

from __future__ import annotations

import queue
import time

import pytest
import torch

from lmi_serve.engine.beams.rows import BeamSearch, replay
from lmi_serve.engine.engine import Engine
from lmi_serve.engine.handle import RequestHandle
from lmi_serve.engine.kv.encdec import ENCODER_DECODER
from lmi_serve.engine.kv.protocol import KVLayout
from lmi_serve.engine.kv.select import KV_LAYOUTS
from lmi_serve.engine.scheduler import Scheduler
from lmi_serve.engine.static_batch import generate_static_batch
from lmi_serve.engine.types import FinishReason, GenerationRequest, GenerationResult, SamplingParams, StopParams
from lmi_serve.errors import ClientGone, Overloaded

from beam_reference import reference_beam_search  # noqa: E402
from waiting import within  # noqa: E402

from tiny_seq2seq import tiny_seq2seq  # noqa: E402

CPU = torch.device("cpu")
PROMPTS = ["The capital of France is", "Once upon a time", "def fib(n):"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """As in test_architectures.py: tiny models gain nothing from intra-op threads, and on a busy
    2-core machine their synchronisation makes each forward many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def beam_request(tokenizer, prompt: str, max_new_tokens: int = 8, eos: tuple[int, ...] = (),
                 repetition_penalty: float = 1.0) -> GenerationRequest:
    return GenerationRequest(tuple(tokenizer(prompt).input_ids), SamplingParams(repetition_penalty=repetition_penalty),
                             StopParams(max_new_tokens=max_new_tokens,
                                        eos_token_ids=frozenset({tokenizer.eos_token_id, *eos})))


def greedy(tokenizer, prompt: str, n: int) -> GenerationRequest:
    return GenerationRequest(tuple(tokenizer(prompt).input_ids), SamplingParams(),
                             StopParams(max_new_tokens=n, ignore_eos=True))


def search_alone(model, tokenizer, request: GenerationRequest, k: int, layout) -> list[GenerationResult]:
    job = BeamSearch(request, k, model, layout, pad_id=tokenizer.pad_token_id, device=CPU)
    while not job.step():
        pass
    return replay(request, tokenizer, job.hypotheses())


def ids(result: GenerationResult) -> list[int]:
    return [e.token_id for e in result.events]


def assert_same_beams(got: list[GenerationResult], expected: list[GenerationResult]) -> None:
    assert [ids(r) for r in got] == [ids(r) for r in expected]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in expected]
    assert [r.text for r in got] == [r.text for r in expected]
    for mine, theirs in zip(got, expected):
        assert [e.logprob for e in mine.events] == pytest.approx([e.logprob for e in theirs.events], abs=1e-4)
        assert all(e.finish_reason is None for e in mine.events[:-1])


# -- the same beams as transformers' generate ------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(KV_LAYOUTS))
@pytest.mark.parametrize("penalty", [1.0, 1.3])
@pytest.mark.parametrize("k", [2, 4])
def test_beams_equal_transformers_generate(k, penalty, kind, tiny_model, smollm2_tokenizer):
    """Several prompts, each with max_new_tokens hit by every beam, then with an EOS the search
    reaches (the token the best beam chose at its sixth step, declared EOS)."""
    tok = smollm2_tokenizer
    for prompt in PROMPTS:
        request = beam_request(tok, prompt, repetition_penalty=penalty)
        expected = reference_beam_search(tiny_model, tok, CPU, request, k)
        assert len(expected) == k and all(r.finish_reason is FinishReason.LENGTH for r in expected)  # premise
        assert_same_beams(search_alone(tiny_model, tok, request, k, KV_LAYOUTS[kind]), expected)

        request = beam_request(tok, prompt, eos=(expected[0].events[5].token_id,), repetition_penalty=penalty)
        expected = reference_beam_search(tiny_model, tok, CPU, request, k)
        assert any(r.finish_reason is FinishReason.EOS_TOKEN for r in expected)  # premise: EOS reached
        assert_same_beams(search_alone(tiny_model, tok, request, k, KV_LAYOUTS[kind]), expected)


@pytest.mark.parametrize("length_penalty, early_stopping", [(2.0, True), (0.5, "never"), (-1.0, False)])
def test_beams_follow_the_models_length_penalty_and_early_stopping(length_penalty, early_stopping, tiny_model,
                                                                   smollm2_tokenizer, monkeypatch):
    """generate() reads both from the model's generation config; so does the engine. Several EOS
    tokens (each beam's second token) make hypotheses finish early and compete."""
    tok = smollm2_tokenizer
    monkeypatch.setattr(tiny_model.generation_config, "length_penalty", length_penalty)
    monkeypatch.setattr(tiny_model.generation_config, "early_stopping", early_stopping)
    request = beam_request(tok, PROMPTS[1], max_new_tokens=10)
    eos = tuple({r.events[1].token_id for r in reference_beam_search(tiny_model, tok, CPU, request, 3)})
    request = beam_request(tok, PROMPTS[1], max_new_tokens=10, eos=eos)
    expected = reference_beam_search(tiny_model, tok, CPU, request, 3)
    assert_same_beams(search_alone(tiny_model, tok, request, 3, KV_LAYOUTS["slots"]), expected)


@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_encoder_decoder_beams_equal_transformers_generate(kind, smollm2_tokenizer):
    tok = smollm2_tokenizer
    model = tiny_seq2seq(kind, len(tok))
    for prompt in PROMPTS[:2]:
        request = beam_request(tok, prompt, max_new_tokens=6, repetition_penalty=1.2)
        expected = reference_beam_search(model, tok, CPU, request, 3)
        assert_same_beams(search_alone(model, tok, request, 3, ENCODER_DECODER), expected)


# -- beams inside the rolling batch -----------------------------------------------------------------


def alone(model, tokenizer, request) -> list[int]:
    return [event.token_id for _, event in generate_static_batch(model, tokenizer, CPU, [request])]


def add_request(scheduler: Scheduler, request: GenerationRequest) -> tuple[RequestHandle, queue.SimpleQueue]:
    sink: queue.SimpleQueue = queue.SimpleQueue()
    handle = RequestHandle(request, None, sink=sink)
    scheduler.add(handle)
    return handle, sink


def add_beams(scheduler: Scheduler, request: GenerationRequest, k: int, layout=None) -> BeamSearch:
    job = BeamSearch(request, k, scheduler.model, layout or scheduler.kv_layout,
                     pad_id=scheduler.tokenizer.pad_token_id, device=CPU)
    scheduler.add_beams(job)
    return job


def finish(scheduler: Scheduler, handle: RequestHandle, steps: int = 100) -> GenerationResult:
    for _ in range(steps):
        if not scheduler.batch and not scheduler.waiting and not scheduler.beams:
            break
        scheduler.step()
    return within(handle.result)


@pytest.mark.parametrize("kind", sorted(KV_LAYOUTS))
def test_beams_and_rows_advance_in_the_same_steps(kind, tiny_model, smollm2_tokenizer):
    """Each step gives the ordinary row one token and the beam search one token per beam: the row
    never waits for the whole search. Both come out as they would alone."""
    tok = smollm2_tokenizer
    scheduler = Scheduler(tiny_model, tok, CPU, max_batch_size=8, max_queue=10, kv_layout=KV_LAYOUTS[kind])
    row_request = greedy(tok, PROMPTS[2], 12)
    handle, sink = add_request(scheduler, row_request)
    search = beam_request(tok, PROMPTS[0], max_new_tokens=6)
    job = add_beams(scheduler, search, 4)
    steps = 0
    while not job.future.done():
        tokens = sink.qsize()
        scheduler.step()
        steps += 1
        assert sink.qsize() > tokens  # the row got a token in this step too
        assert scheduler.running == (1 + 4 if not job.future.done() else 1)
    assert steps == 6  # one step per beam token: the search never ran ahead of the batch
    assert_same_beams(replay(search, tok, job.future.result()), reference_beam_search(tiny_model, tok, CPU, search, 4))
    assert ids(finish(scheduler, handle)) == alone(tiny_model, tok, row_request)


def test_beam_rows_count_against_the_batch_and_cancelling_frees_them(tiny_model, smollm2_tokenizer):
    """max_batch_size 3: two rows run; a 2-beam search waits and holds the free row, so a request
    queued after it waits too; it starts when a row leaves; cancelled, its rows go in one step."""
    tok = smollm2_tokenizer
    scheduler = Scheduler(tiny_model, tok, CPU, max_batch_size=3, max_queue=10)
    short, _ = add_request(scheduler, greedy(tok, PROMPTS[0], 3))
    add_request(scheduler, greedy(tok, PROMPTS[1], 30))
    scheduler.step()
    job = add_beams(scheduler, beam_request(tok, PROMPTS[2], max_new_tokens=20), 2)
    _, late_sink = add_request(scheduler, greedy(tok, PROMPTS[0], 5))
    while not scheduler.beams.running:
        scheduler.step()
        assert late_sink.qsize() == 0, "a request queued after the beam search took its row"
    assert within(short.result).generated_tokens == 3  # the search started when that row left
    assert scheduler.running == 3
    for _ in range(2):
        scheduler.step()
        assert late_sink.qsize() == 0 and scheduler.running == 3  # the batch is full of beams and a row
    job.cancel()
    scheduler.step()
    assert not scheduler.beams and job.future.cancelled()
    assert late_sink.qsize() >= 1 and scheduler.running == 2  # admitted in the very step that dropped the beams


def test_a_waiting_beam_search_cancelled_never_starts(tiny_model, smollm2_tokenizer):
    tok = smollm2_tokenizer
    scheduler = Scheduler(tiny_model, tok, CPU, max_batch_size=2, max_queue=10)
    handle, _ = add_request(scheduler, greedy(tok, PROMPTS[0], 4))
    add_request(scheduler, greedy(tok, PROMPTS[1], 4))
    scheduler.step()
    job = add_beams(scheduler, beam_request(tok, PROMPTS[2]), 2)
    job.cancel()
    finish(scheduler, handle)
    assert not scheduler.beams and job.future.cancelled()


class FailingDecode(KVLayout):
    """A KV layout whose batches fail at their first decode (the prefill works)."""

    def __init__(self, layout):
        self.layout = layout

    def prefill(self, *args, **kwargs):
        out = self.layout.prefill(*args, **kwargs)

        def decode():
            raise RuntimeError("poisoned beam step")

        out.kv.decode = decode
        return out


def test_a_failing_beam_search_fails_alone(tiny_model, smollm2_tokenizer):
    tok = smollm2_tokenizer
    scheduler = Scheduler(tiny_model, tok, CPU, max_batch_size=8, max_queue=10)
    row_request = greedy(tok, PROMPTS[1], 8)
    handle, _ = add_request(scheduler, row_request)
    failing = add_beams(scheduler, beam_request(tok, PROMPTS[0]), 2, FailingDecode(scheduler.kv_layout))
    search = beam_request(tok, PROMPTS[2], max_new_tokens=5)
    healthy = add_beams(scheduler, search, 2)
    assert ids(finish(scheduler, handle)) == alone(tiny_model, tok, row_request)
    assert isinstance(failing.future.exception(timeout=0), RuntimeError)
    assert scheduler.stats.failed_steps == 1
    assert_same_beams(replay(search, tok, healthy.future.result(timeout=0)),
                      reference_beam_search(tiny_model, tok, CPU, search, 2))


# -- through the engine -----------------------------------------------------------------------------


def test_engine_beam_search_beside_a_stream(tiny_model, smollm2_tokenizer):
    tok = smollm2_tokenizer
    engine = Engine(tiny_model, tok, CPU, max_batch_size=8).start()
    try:
        row_request = greedy(tok, "Once upon a time", 20)
        rolling = engine.submit(row_request)
        search = beam_request(tok, PROMPTS[0], max_new_tokens=6)
        beams = within(lambda: engine.beam_search(search, 2))
        assert_same_beams(beams, reference_beam_search(tiny_model, tok, CPU, search, 2))
        assert ids(within(rolling.result)) == alone(tiny_model, tok, row_request)
    finally:
        engine.stop()


def test_shutdown_fails_beam_searches_and_a_full_queue_refuses(tiny_model, smollm2_tokenizer):
    tok = smollm2_tokenizer
    engine = Engine(tiny_model, tok, CPU, max_batch_size=4, max_queue=1)  # its thread never starts
    running = engine.submit_beams(beam_request(tok, PROMPTS[0]), 2)
    engine.scheduler.step()
    waiting = engine.submit_beams(beam_request(tok, PROMPTS[1]), 4)  # does not fit beside the first
    with pytest.raises(Overloaded):
        engine.submit_beams(beam_request(tok, PROMPTS[2]), 2)
    engine.scheduler.step()
    assert engine.scheduler.beams.running == [running] and list(engine.scheduler.beams.waiting) == [waiting]
    engine.scheduler.abort_all("the engine stopped")  # what Engine.stop() does after its loop ends
    for job in (running, waiting):
        assert "stopped" in str(job.future.exception(timeout=0))
    assert engine.scheduler.running == 0


def test_a_beam_search_whose_client_left_is_dropped(tiny_model, smollm2_tokenizer):
    tok = smollm2_tokenizer
    engine = Engine(tiny_model, tok, CPU, max_batch_size=8).start()
    checks = []

    def client_gone() -> bool:  # the client leaves once the search has run a few steps
        checks.append(engine.scheduler.stats.steps)
        return engine.scheduler.beams.rows > 0 and len(checks) > 3

    try:
        with pytest.raises(ClientGone):
            endless = GenerationRequest(tuple(tok(PROMPTS[0]).input_ids), SamplingParams(),
                                        StopParams(max_new_tokens=400, ignore_eos=True))
            engine.beam_search(endless, 4, client_gone)
        deadline = time.monotonic() + 60  # its rows are freed at the next step
        while engine.scheduler.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.scheduler.running == 0 and not engine.scheduler.beams
        # Dropped, not run to its end: 400 tokens take 400 steps (a tighter bound raced the 50 ms poll on a busy box).
        assert engine.scheduler.stats.steps < 400
    finally:
        engine.stop()


def test_a_starting_beam_search_takes_its_prompt_from_the_steps_prefill_budget(tiny_model, smollm2_tokenizer):
    """Its first step prefills its prompt beside the step's joiners: together they stay within the budget
    that bounds the longest gap, so a joiner that does not fit what the search leaves is prefilled a chunk
    of that size now and the rest next step."""
    tok = smollm2_tokenizer
    search = beam_request(tok, PROMPTS[0], max_new_tokens=4)
    row_request = greedy(tok, PROMPTS[2], 4)
    beam_tokens, row_tokens = len(search.prompt_ids), len(row_request.prompt_ids)
    budget = beam_tokens + row_tokens - 1  # one short of both
    assert row_tokens <= budget
    scheduler = Scheduler(tiny_model, tok, CPU, max_batch_size=8, max_queue=10, max_prefill_tokens=budget)
    job = add_beams(scheduler, search, 2)
    assert scheduler.beams.prompt_tokens == 0  # waiting, not running yet
    handle, _ = add_request(scheduler, row_request)
    scheduler.step()
    assert scheduler.beams.prompt_tokens == 0 and job.prompt_pending == 0  # its prompt is in
    # the row's first chunk took no more than what the search left (fewer: chunked.py counts its attention)
    assert not scheduler.waiting and 0 < scheduler.chunking.done <= budget - beam_tokens < row_tokens
    assert ids(finish(scheduler, handle)) == alone(tiny_model, tok, row_request)
    assert job.future.result(timeout=60)
