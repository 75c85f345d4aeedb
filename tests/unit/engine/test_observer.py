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
