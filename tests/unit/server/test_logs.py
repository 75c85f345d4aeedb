"""Log formats (`--log-format` / LMI_SERVE_LOG_FORMAT) and the access line's fields."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from lmi_serve.__main__ import parse_args
from lmi_serve.engine.observer import RequestTally
from lmi_serve.server import logs
from lmi_serve.server.access_log import line_fields


def record(message: str, **extra) -> logging.LogRecord:
    rec = logging.LogRecord("lmi_serve.access", logging.INFO, __file__, 1, message, (), None)
    rec.__dict__.update(extra)
    return rec


def test_json_lines_carry_the_extra_fields_on_one_line():
    line = logs.formatter("json").format(record("a\nb", status=200, model=None))
    assert "\n" not in line
    parsed = json.loads(line)
    assert parsed["message"] == "a\nb" and parsed["status"] == 200 and parsed["model"] is None
    assert {"time", "level", "process", "logger"} <= set(parsed) and parsed["logger"] == "lmi_serve.access"


def test_text_is_the_default(monkeypatch):
    monkeypatch.delenv("LMI_SERVE_LOG_FORMAT", raising=False)
    assert parse_args([]).log_format == "text"
    assert parse_args(["--log-format", "json"]).log_format == "json"
    monkeypatch.setenv("LMI_SERVE_LOG_FORMAT", "json")
    assert parse_args([]).log_format == "json"


def test_a_bad_format_stops_the_launcher(monkeypatch, capsys):
    monkeypatch.setenv("LMI_SERVE_LOG_FORMAT", "xml")
    with pytest.raises(SystemExit) as info:
        parse_args([])
    assert info.value.code == 2 and "LMI_SERVE_LOG_FORMAT" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--log-format", "xml"])


def test_gunicorn_logs_through_the_root_handler():
    config = logs.gunicorn_logconfig("info", "json")
    assert config["loggers"]["gunicorn.error"] == {"level": "INFO", "handlers": [], "propagate": True}
    assert config["formatters"]["lmi"]["log_format"] == "json"


def test_a_request_without_sequences_has_no_token_fields():
    fields = line_fields({"status": 200}, RequestTally(), started=10.0, now=10.5)
    assert fields == {"status": 200, "prompt_tokens": None, "generated_tokens": None, "ttft_s": None,
                      "total_s": 0.5}


def test_the_tally_sums_sequences_and_keeps_the_first_token():
    tally = RequestTally()
    tally.add(5, submitted=2.0)
    tally.add(5, submitted=1.0)
    tally.generated_tokens, tally.first_token = 7, 1.25
    fields = line_fields({}, tally, started=0.5, now=3.0)
    assert (fields["prompt_tokens"], fields["generated_tokens"], fields["ttft_s"]) == (10, 7, 0.25)


def test_a_clock_made_while_a_tally_is_current_counts_into_it():
    from lmi_serve.engine.observer import CURRENT_TALLY, EngineObserver, SequenceClock
    from lmi_serve.engine.types import FinishReason, TokenEvent

    tally = RequestTally()
    token = CURRENT_TALLY.set(tally)
    try:
        clocks = [SequenceClock(EngineObserver(), 4, submitted=0.0), SequenceClock(EngineObserver(), 4, submitted=0.0)]
    finally:
        CURRENT_TALLY.reset(token)
    outside = SequenceClock(EngineObserver(), 9, submitted=0.0)  # made when no request is counting
    for clock in (*clocks, outside):
        clock.event(TokenEvent(token_id=1, text="a", logprob=0.0, special=False))
        clock.event(TokenEvent(token_id=2, text="b", logprob=0.0, special=False, finish_reason=FinishReason.LENGTH))
    assert (tally.sequences, tally.prompt_tokens, tally.generated_tokens) == (2, 8, 4)
    assert tally.first_token is not None and tally.ttft_seconds > 0


def test_the_launcher_silences_the_gguf_conversions_tqdm_bar():
    """transformers converts a GGUF under a bare `tqdm.auto` bar (modeling_gguf_pytorch_utils), which
    would put carriage-return frames between JSON log lines; the launcher's environment turns every
    tqdm bar off before transformers loads. Checked in a fresh interpreter, as the server starts."""
    code = ("import os, sys\n"
            "from lmi_serve import __main__ as launcher\n"
            "for key, value in launcher._RUNTIME_ENV.items(): os.environ.setdefault(key, value)\n"
            "import transformers.modeling_gguf_pytorch_utils as gguf_utils\n"
            "for _ in gguf_utils.tqdm(range(50), desc='Converting and de-quantizing GGUF tensors...'): pass\n")
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    # the launcher's environment, and (so that the check can see a bar) none: both interpreters at once
    launched, bare = (subprocess.Popen([sys.executable, "-c", source], env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
                      for source in (code, code.replace("os.environ.setdefault(key, value)", "pass")))
    out, err = launched.communicate(timeout=300)
    assert launched.returncode == 0, err
    assert "Converting" not in err + out and "it/s" not in err
    assert "Converting and de-quantizing GGUF tensors" in bare.communicate(timeout=300)[1]


@pytest.mark.parametrize("log_format", logs.FORMATS)
def test_no_line_is_longer_than_the_cap(log_format):
    """A message quoting a client's 1 MB field and a traceback of one are cut; a JSON line stays JSON
    (its message kept from the start); an ordinary line is written whole."""
    form = logs.formatter(log_format)
    huge = "x" * 1_000_000
    try:
        raise ValueError(huge)
    except ValueError:
        failed = logging.LogRecord("lmi_serve.x", logging.ERROR, __file__, 1, "field %s refused", (huge,),
                                   sys.exc_info())
    for rec in (record("unknown " + huge), failed):
        out = form.format(rec)
        assert max(len(line) for line in out.split("\n")) <= logs.LINE_CHARS
        assert "more characters]" in out
        if log_format == "json":
            assert "\n" not in out and json.loads(out)["message"].startswith(rec.getMessage()[:100])
    short = record("ping", status=200)
    assert form.format(short) == logs.formatter(log_format).inner.format(short)
