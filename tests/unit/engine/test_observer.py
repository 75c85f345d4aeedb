"""SequenceClock turns one sequence's events into the observer's calls, with the right counts."""

from __future__ import annotations

from lmi_serve.engine.observer import EngineObserver, SequenceClock
from lmi_serve.engine.types import FinishReason, TokenEvent
from lmi_serve.errors import Timeout


class Recorder(EngineObserver):
    def __init__(self):
        self.calls = []

    def sequence_admitted(self, queue_seconds):
        self.calls.append(("admitted", queue_seconds))

    def first_token(self, prompt_tokens, seconds):
        self.calls.append(("first", prompt_tokens))

    def next_token(self, gap_seconds):
        self.calls.append(("next", gap_seconds))

    def sequence_finished(self, report):
        self.calls.append(("finished", report))


def token(finish=None):
    return TokenEvent(7, "x", -0.1, False, finish)


def test_a_finished_sequence_reports_first_token_then_gaps_then_its_totals():
    recorder = Recorder()
    clock = SequenceClock(recorder, prompt_tokens=11, submitted=0.0)
    clock.admit()
    for event in (token(), token(), token(FinishReason.LENGTH)):
        clock.event(event)
    kinds = [call[0] for call in recorder.calls]
    assert kinds == ["admitted", "first", "next", "next", "finished"]
    assert recorder.calls[1] == ("first", 11)
    report = recorder.calls[-1][1]
    assert (report.finish_reason, report.generated_tokens, report.prompt_tokens, report.error_kind) == \
        (FinishReason.LENGTH, 3, 11, None)
    assert report.queue_seconds is not None and report.first_token_seconds is not None
    assert report.decode_seconds >= 0 and report.e2e_seconds >= report.first_token_seconds


def test_a_failure_marker_is_no_token_and_carries_its_kind():
    recorder = Recorder()
    clock = SequenceClock(recorder, prompt_tokens=5, submitted=0.0)
    clock.event(TokenEvent.failure("waited too long", kind=Timeout))
    (kind, report), = recorder.calls
    assert kind == "finished"
    assert (report.finish_reason, report.error_kind, report.generated_tokens) == (FinishReason.ERROR, Timeout, 0)
    assert report.queue_seconds is None and report.first_token_seconds is None and report.decode_seconds is None


def test_a_cancelled_sequence_counts_the_tokens_it_got():
    recorder = Recorder()
    clock = SequenceClock(recorder, prompt_tokens=5, submitted=0.0)
    clock.admit()
    clock.event(token())
    clock.event(TokenEvent.cancelled())
    report = recorder.calls[-1][1]
    assert (report.finish_reason, report.generated_tokens, report.error_kind) == (FinishReason.CANCELLED, 1, None)


# -- through a real engine (the tiny model) ------------------------------------------------------

class EngineRecorder(Recorder):
    def __init__(self):
        super().__init__()
        self.steps = []

    def step_finished(self, report):
        self.steps.append(report)


def test_an_observed_engine_reports_every_sequence_and_step(tiny_model, smollm2_tokenizer):
    import torch

    from lmi_serve.engine.engine import Engine
    from lmi_serve.engine.types import GenerationRequest, SamplingParams, StopParams
    from waiting import within

    recorder = EngineRecorder()
    engine = Engine(tiny_model, smollm2_tokenizer, torch.device("cpu"), max_batch_size=2, max_queue=10)
    engine.observe(recorder)
    prompts = [tuple(smollm2_tokenizer.encode(p, add_special_tokens=False)) for p in ("Hello there", "A cat", "Why")]
    handles = [engine.submit(GenerationRequest(p, SamplingParams(), StopParams(max_new_tokens=4, ignore_eos=True)))
               for p in prompts]
    dropped = engine.submit(GenerationRequest(prompts[0], SamplingParams(), StopParams(max_new_tokens=4)))
    dropped.cancel()  # before the engine starts: never admitted
    engine.start()
    try:
        for handle in handles:
            assert within(handle.result).generated_tokens == 4
        within(lambda: list(dropped))
    finally:
        engine.stop()
    kinds = [call[0] for call in recorder.calls]
    assert (kinds.count("admitted"), kinds.count("first"), kinds.count("next"), kinds.count("finished")) == (3, 3, 9, 4)
    assert sorted(call[1] for call in recorder.calls if call[0] == "first") == sorted(len(p) for p in prompts)
    reports = [call[1] for call in recorder.calls if call[0] == "finished"]
    assert sorted(r.finish_reason.value for r in reports) == ["cancelled", "length", "length", "length"]
    assert [r.queue_seconds for r in reports if r.finish_reason is FinishReason.CANCELLED] == [None]
    assert max(step.batch_size for step in recorder.steps) == 2  # max_batch_size rows decoded together
    assert recorder.steps[-1].running == 0 and recorder.steps[-1].waiting == 0
    # K/V bytes held: some while rows run; none once the batch emptied (its buffers went with it)
    assert all(step.kv_cache_bytes > 0 for step in recorder.steps if step.running)
    assert recorder.steps[-1].kv_cache_bytes == 0
