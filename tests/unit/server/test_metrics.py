"""metrics.py in one process (no PROMETHEUS_MULTIPROC_DIR): observer facts and HTTP counts become
exactly the series docs/operations.md lists, and /metrics answers while a model is still loading."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lmi_serve.__main__ import DEFAULT_STORE
from lmi_serve.config.sources import build_server_config
from lmi_serve.engine.observer import SequenceReport, StepReport
from lmi_serve.engine.types import FinishReason
from lmi_serve.errors import GenerationFailed
from lmi_serve.server.app import create_app
from lmi_serve.server.metrics import ServingMetrics
from lmi_serve.serving.registry import ModelRegistry
from lmi_serve.serving.service import ModelService


def scrape(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name, **labels) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and wanted <= lab)


def report(reason, tokens, error_kind=None):
    return SequenceReport(finish_reason=reason, error_kind=error_kind, prompt_tokens=9, generated_tokens=tokens,
                          e2e_seconds=1.0, queue_seconds=0.1, first_token_seconds=0.2,
                          decode_seconds=0.8 if tokens else None)


@pytest.fixture
def metrics(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    return ServingMetrics()


def test_observer_facts_become_counts_and_histograms(metrics):
    model = metrics.for_model("m")
    model.model_loaded(2.5)
    model.sequence_admitted(0.1)
    model.first_token(9, 0.2)
    for _ in range(4):
        model.next_token(0.2)
    model.sequence_finished(report(FinishReason.LENGTH, 5))
    model.sequence_finished(report(FinishReason.EOS_TOKEN, 5))
    model.sequence_finished(report(FinishReason.CANCELLED, 2))
    model.sequence_finished(report(FinishReason.ERROR, 0, GenerationFailed))
    model.step_finished(StepReport(batch_size=3, running=3, waiting=2, prefix_query_tokens=64, prefix_hit_tokens=32,
                                   draft_tokens=4, accepted_draft_tokens=3))
    model.step_finished(StepReport(batch_size=0, running=1, waiting=0, prefix_query_tokens=80, prefix_hit_tokens=32,
                                   draft_tokens=10, accepted_draft_tokens=3))
    s = scrape(metrics.render()[0].decode())
    p = "lmi_serve:"
    assert value(s, p + "prompt_tokens_total", model_name="m") == 9
    assert value(s, p + "generation_tokens_total", model_name="m") == 5
    assert value(s, p + "time_to_first_token_seconds_count", model_name="m") == 1
    assert value(s, p + "inter_token_latency_seconds_count", model_name="m") == 4
    assert value(s, p + "request_time_per_output_token_seconds_count", model_name="m") == 3  # sequences of 2+ tokens
    assert value(s, p + "time_per_output_token_seconds_count", model_name="m") == 4  # vLLM's per-gap name
    assert value(s, p + "e2e_request_latency_seconds_count", model_name="m") == 4
    assert value(s, p + "request_queue_time_seconds_count", model_name="m") == 1
    assert value(s, p + "request_success_total", finished_reason="length") == 1
    assert value(s, p + "request_success_total", finished_reason="stop") == 1
    assert value(s, p + "request_cancelled_total", model_name="m") == 1
    assert value(s, p + "generation_failures_total", kind="GenerationFailed") == 1
    assert value(s, p + "batch_size_count", model_name="m") == 1  # a step without a decode is no batch
    assert value(s, p + "num_requests_running", model_name="m") == 1
    assert value(s, p + "num_requests_waiting", model_name="m") == 0
    assert value(s, p + "prefix_cache_queries_total", model_name="m") == 80
    assert value(s, p + "prefix_cache_hits_total", model_name="m") == 32
    assert value(s, p + "spec_decode_num_draft_tokens_total", model_name="m") == 10  # the engine's totals, not sums
    assert value(s, p + "spec_decode_num_accepted_tokens_total", model_name="m") == 3
    assert value(s, p + "model_load_time_seconds", model_name="m") == 2.5
    assert value(s, p + "model_loads_total", model_name="m") == 1


@pytest.fixture
def loading_client(monkeypatch):
    """An app whose one model never starts loading: every model route would answer 503."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    config = build_server_config({"HOME": "/tmp"}, default_store=DEFAULT_STORE)
    simple = next(model for model in config.models if model.name == "simple")
    config = config.model_copy(update={"models": (simple,)})
    return create_app(config, ModelRegistry([ModelService(simple, config.cache_dir)])).test_client()


def test_metrics_answers_while_loading_and_counts_every_other_response(loading_client):
    assert loading_client.get("/ping").status_code == 503
    assert loading_client.get("/no/such/route").status_code == 404
    assert loading_client.post("/v2/models/simple/generate", data=b"{}").status_code == 503
    response = loading_client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    s = scrape(response.get_data(as_text=True))
    requests = "lmi_serve:http_requests_total"
    assert value(s, requests) == 3  # /metrics itself is not counted
    assert value(s, requests, dialect="lmi", route="/ping", status_class="5xx", model_name="") == 1
    assert value(s, requests, dialect="none", route="unmatched", status_class="4xx") == 1
    assert value(s, requests, dialect="triton", model_name="simple", status_class="5xx") == 1
    assert value(s, "lmi_serve:request_errors_total", kind="NotFound") == 1
    assert value(s, "lmi_serve:request_errors_total") == 3


def test_sequences_on_lora_adapters_are_counted_per_adapter(metrics):
    model = metrics.for_model("m")
    for adapter in ("sql", "sql", "chat", None):
        model.sequence_finished(SequenceReport(
            finish_reason=FinishReason.LENGTH, error_kind=None, prompt_tokens=3, generated_tokens=2,
            e2e_seconds=1.0, queue_seconds=0.1, first_token_seconds=0.2, decode_seconds=0.5, adapter=adapter))
    s = scrape(metrics.render()[0].decode())
    assert value(s, "lmi_serve:lora_requests_total", model_name="m", lora_name="sql") == 2
    assert value(s, "lmi_serve:lora_requests_total", model_name="m", lora_name="chat") == 1
    assert value(s, "lmi_serve:lora_requests_total", model_name="m") == 3


def test_a_scrape_survives_an_empty_and_a_vanished_worker_file(tmp_path, monkeypatch):
    """Multiprocess mode: a starting (or killed-while-starting) worker's file is empty for a moment (or
    for good), and a dead worker's gauge file can vanish between listing and reading; neither may
    fail the scrape (a 500), and the settled files' values are all there."""
    import glob as glob_module

    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    from lmi_serve.server.metrics import SettledFilesCollector

    written = MmapedDict(str(tmp_path / "counter_101.db"))
    written.write_value(mmap_key("lmi_serve:demo", "lmi_serve:demo_total", ("model_name",), ("m",), "demo"), 7.0, 0.0)
    written.close()
    (tmp_path / "gauge_livesum_102.db").touch()  # created, never sized
    listed = glob_module.glob
    monkeypatch.setattr(glob_module, "glob", lambda pattern: [*listed(pattern), str(tmp_path / "gauge_livesum_103.db")])
    registry = CollectorRegistry()
    SettledFilesCollector(registry, path=str(tmp_path))
    samples = scrape(generate_latest(registry).decode())
    assert value(samples, "lmi_serve:demo_total", model_name="m") == 7.0
