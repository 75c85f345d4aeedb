"""What records a request its generation deadline cut (option.generation_deadline): the engine's count in the
request's tally and its sequence report, the /metrics counter, the access line and the response headers."""

from __future__ import annotations

import pytest
from flask import Flask, Response, g
from prometheus_client.parser import text_string_to_metric_families

from lmi_serve.engine.observer import EngineObserver, RequestTally, SequenceClock, SequenceReport
from lmi_serve.engine.types import FinishReason, TokenEvent
from lmi_serve.server.access_log import line_fields
from lmi_serve.server.app import DEADLINE_HEADER, mark_deadline_cut
from lmi_serve.server.metrics import ServingMetrics

def cut_event() -> TokenEvent:
    return TokenEvent(5, "x", -0.1, False, FinishReason.LENGTH, deadline_cut=True)


def test_the_tally_and_the_report_count_cut_sequences_only():
    reports = []

    class Observer(EngineObserver):
        def sequence_finished(self, report: SequenceReport) -> None:
            reports.append(report)

    tally = RequestTally()
    for last in (cut_event(), TokenEvent(5, "x", -0.1, False, FinishReason.LENGTH), TokenEvent.deadline_reached()):
        clock = SequenceClock(Observer(), prompt_tokens=3, submitted=0.0)
        clock.tally = tally
        clock.event(last)
    assert [r.deadline_cut for r in reports] == [True, False, True]
    assert [r.finish_reason for r in reports] == [FinishReason.LENGTH] * 3
    assert tally.deadline_cuts == 2 and tally.generated_tokens == 2  # the token-less end is no token


def test_the_counter_counts_cut_sequences_beside_their_length_finish(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    metrics = ServingMetrics()
    model = metrics.for_model("m")
    for cut in (True, True, False):
        model.sequence_finished(SequenceReport(FinishReason.LENGTH, None, 3, 2, 1.0, 0.1, 0.2, 0.5, deadline_cut=cut))
    samples = {(s.name, s.labels.get("finished_reason")): s.value
               for family in text_string_to_metric_families(metrics.render()[0].decode()) for s in family.samples}
    assert samples[("lmi_serve:generation_deadline_exceeded_total", None)] == 2
    assert samples[("lmi_serve:request_success_total", "length")] == 3


def test_the_access_line_says_so_only_when_a_sequence_was_cut():
    tally = RequestTally(sequences=1, prompt_tokens=3, generated_tokens=2)
    assert "deadline_exceeded" not in line_fields({}, tally, started=0.0, now=1.0)
    tally.deadline_cuts = 1
    assert line_fields({}, tally, started=0.0, now=1.0)["deadline_exceeded"] is True


@pytest.mark.parametrize("attributes, expected", [
    (None, "lmi-deadline-exceeded=true"),
    ("trace=7", "trace=7;lmi-deadline-exceeded=true"),  # a handler's own custom attributes are kept
])
def test_headers_of_a_cut_response(attributes, expected):
    app = Flask(__name__)
    with app.test_request_context("/invocations", method="POST"):
        g.access_tally = RequestTally(sequences=1)
        plain = Response("{}")
        mark_deadline_cut(plain)
        assert DEADLINE_HEADER not in plain.headers
        g.access_tally.deadline_cuts = 1
        cut = Response("{}")
        if attributes:
            cut.headers["X-Amzn-SageMaker-Custom-Attributes"] = attributes
        mark_deadline_cut(cut)
        assert cut.headers[DEADLINE_HEADER] == "true"
        assert cut.headers["X-Amzn-SageMaker-Custom-Attributes"] == expected
