"""Prometheus metrics: the engine's observer facts and the HTTP layer's request counts, as `/metrics`.

Under gunicorn every worker process counts on its own; prometheus_client's multiprocess mode
keeps each process's values in files under PROMETHEUS_MULTIPROC_DIR and `/metrics` (answered by
any worker) adds them up. The launcher (`__main__.py`) makes that folder fresh per server start,
before any worker imports prometheus_client (the value store is chosen at import), and marks a
dead worker's gauges gone (`worker_exited`, gunicorn's child_exit hook). Without the variable
(Flask's test client, one process) the values live in this object's own registry.

Names follow vLLM's (`vllm:` -> `lmi_serve:`) where vLLM has the metric, so dashboards map over.
"""

from __future__ import annotations

import glob
import os
import shutil
import struct

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import multiprocess
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4  # the text format every scraper reads

from lmi_serve.engine.observer import EngineObserver, SequenceReport, StepReport
from lmi_serve.engine.types import FinishReason

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
PREFIX = "lmi_serve:"

# Buckets span a GPU's milliseconds and a loaded CPU's minutes.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)

# The engine's reasons, in vLLM's words (dialects own the words they show clients).
SUCCESS_REASONS = {FinishReason.LENGTH: "length", FinishReason.EOS_TOKEN: "stop", FinishReason.STOP_SEQUENCE: "stop"}


class SettledFilesCollector(multiprocess.MultiProcessCollector):
    """prometheus_client's MultiProcessCollector, minus two races that fail a whole scrape (a 500):
    a file removed between its listing and its reading (a dead worker's gauges, `worker_exited`),
    and a file still empty (a starting worker's: prometheus_client creates it, then sizes it; one
    whose creator was killed in between stays empty, and would fail every scrape after it). Empty
    files hold no value yet and are skipped; a vanished one is retried with a fresh listing."""

    ATTEMPTS = 3

    def collect(self):
        for attempt in range(self.ATTEMPTS):
            try:
                return self.merge(self._settled_files(), accumulate=True)
            except (FileNotFoundError, struct.error):
                if attempt == self.ATTEMPTS - 1:
                    raise

    def _settled_files(self) -> list[str]:
        settled = []
        for path in glob.glob(os.path.join(self._path, "*.db")):
            try:
                if os.path.getsize(path) > 0:
                    settled.append(path)
            except FileNotFoundError:
                continue
        return settled


def remove_multiprocess_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def worker_exited(pid: int) -> None:
    """gunicorn's child_exit hook: drop the dead worker's live gauges (its counts stay counted)."""
    if os.environ.get(MULTIPROC_ENV):
        multiprocess.mark_process_dead(pid)


class ServingMetrics:
    """Every series of one process. `for_model(name)` gives the engine observer of one model;
    `count_response` is the HTTP layer's one hook; `render` is the `/metrics` body."""

    def __init__(self):
        self.multiprocess = bool(os.environ.get(MULTIPROC_ENV))
        # In multiprocess mode values go to files and /metrics reads them all; a registry would
        # only hold this process's (and clash when tests build two apps in one process).
        self._own = None if self.multiprocess else CollectorRegistry()
        model = ("model_name",)
        self.http_requests = self._counter("http_requests", "HTTP requests answered, by model, dialect, route "
                                           "and status class", model + ("dialect", "route", "status_class"))
        self.errors = self._counter("request_errors", "Error responses, by the error's kind", model + ("kind",))
        self.success = self._counter("request_success", "Sequences finished normally, by reason (stop, length)",
                                     model + ("finished_reason",))
        self.cancelled = self._counter("request_cancelled", "Sequences cancelled (the client left)", model)
        self.deadline_cuts = self._counter("generation_deadline_exceeded", "Sequences their generation deadline "
                                           "ended (option.generation_deadline; also counted as length)", model)
        self.failures = self._counter("generation_failures", "Sequences the engine ended with a failure, by kind",
                                      model + ("kind",))
        self.lora_requests = self._counter("lora_requests", "Sequences finished on a LoRA adapter, by adapter",
                                           model + ("lora_name",))
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens prefilled", model)
        self.generation_tokens = self._counter("generation_tokens", "Tokens generated", model)
        self.prefix_queries = self._counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", model)
        self.prefix_hits = self._counter("prefix_cache_hits", "Prompt tokens whose K/V came from the prefix cache",
                                         model)
        self.draft_tokens = self._counter("spec_decode_num_draft_tokens",
                                          "Draft tokens verified (option.draft_model_id=ngram)", model)
        self.accepted_tokens = self._counter("spec_decode_num_accepted_tokens",
                                             "Draft tokens the engine chose (option.draft_model_id=ngram)", model)
        self.ttft = self._histogram("time_to_first_token_seconds", "Submission to the first token",
                                    LATENCY_BUCKETS)
        # vLLM's names: request_time_per_output_token_seconds is a sequence's mean; time_per_output_token_seconds
        # is every token gap (vLLM keeps it as the deprecated twin of inter_token_latency_seconds), so
        # dashboards built on either read ours the same way.
        self.tpot = self._histogram("request_time_per_output_token_seconds", "A sequence's mean time per token "
                                    "after its first", TOKEN_GAP_BUCKETS)
        self.token_gap = self._histogram("time_per_output_token_seconds", "Time between two tokens of a sequence "
                                         "(vLLM's older name of inter_token_latency_seconds)", TOKEN_GAP_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds", "Time between two tokens of a sequence",
                                   TOKEN_GAP_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds", "Submission to the last event of a sequence",
                                   REQUEST_BUCKETS)
        self.queue = self._histogram("request_queue_time_seconds", "Submission to admission into the batch",
                                     LATENCY_BUCKETS)
        self.batch_size = self._histogram("batch_size", "Rows per decode step", BATCH_BUCKETS)
        self.running = self._gauge("num_requests_running", "Rows in the batch", "livesum")
        self.waiting = self._gauge("num_requests_waiting", "Requests queued for a row", "livesum")
        self.prefix_cache_bytes = self._gauge("prefix_cache_bytes", "Bytes the prefix cache holds", "livesum")
        self.kv_cache_bytes = self._gauge("kv_cache_bytes", "Bytes of K/V storage the running batch holds", "livesum")
        self.load_time = self._gauge("model_load_time_seconds", "Seconds the model took to load", "livemax")
        # Every worker loads its own copy: with N workers this is N, and a restarted worker adds one.
        self.loads = self._counter("model_loads", "Times a worker process loaded the model", model)

    def _counter(self, name: str, doc: str, labels: tuple[str, ...]) -> Counter:
        return Counter(PREFIX + name, doc, labels, registry=self._own)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(PREFIX + name, doc, ("model_name",), buckets=buckets, registry=self._own)

    def _gauge(self, name: str, doc: str, mode: str) -> Gauge:
        return Gauge(PREFIX + name, doc, ("model_name",), multiprocess_mode=mode, registry=self._own)

    def for_model(self, name: str) -> "ModelMetrics":
        return ModelMetrics(self, name)

    def count_response(self, model_name: str, dialect: str, route: str, status: int,
                       error_kind: str | None) -> None:
        self.http_requests.labels(model_name, dialect, route, f"{status // 100}xx").inc()
        if status >= 400:
            self.errors.labels(model_name, error_kind or "ErrorResponse").inc()

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of `/metrics`: every live and dead worker's values, added up."""
        if self.multiprocess:
            registry = CollectorRegistry()
            SettledFilesCollector(registry)
        else:
            registry = self._own
        return generate_latest(registry), CONTENT_TYPE_PLAIN_0_0_4


class ModelMetrics(EngineObserver):
    """One model's series, its label children resolved once (a token costs no label lookup)."""

    def __init__(self, metrics: ServingMetrics, name: str):
        self.name = name
        self._metrics = metrics
        self._ttft, self._tpot = metrics.ttft.labels(name), metrics.tpot.labels(name)
        self._itl, self._e2e = metrics.itl.labels(name), metrics.e2e.labels(name)
        self._token_gap = metrics.token_gap.labels(name)
        self._queue, self._batch = metrics.queue.labels(name), metrics.batch_size.labels(name)
        self._prompt, self._generated = metrics.prompt_tokens.labels(name), metrics.generation_tokens.labels(name)
        self._running, self._waiting = metrics.running.labels(name), metrics.waiting.labels(name)
        self._cancelled = metrics.cancelled.labels(name)
        self._deadline_cuts = metrics.deadline_cuts.labels(name)
        self._prefix_queries, self._prefix_hits = metrics.prefix_queries.labels(name), metrics.prefix_hits.labels(name)
        self._prefix_bytes = metrics.prefix_cache_bytes.labels(name)
        self._kv_bytes = metrics.kv_cache_bytes.labels(name)
        self._drafts, self._accepted = metrics.draft_tokens.labels(name), metrics.accepted_tokens.labels(name)
        self._seen_queries = self._seen_hits = 0  # the engine reports totals; the counters take increments
        self._seen_drafts = self._seen_accepted = 0
        self._running.set(0)
        self._waiting.set(0)
        self._kv_bytes.set(0)

    def model_loaded(self, seconds: float) -> None:
        self._metrics.load_time.labels(self.name).set(seconds)
        self._metrics.loads.labels(self.name).inc()

    def sequence_admitted(self, queue_seconds: float) -> None:
        self._queue.observe(queue_seconds)

    def first_token(self, prompt_tokens: int, seconds: float) -> None:
        self._ttft.observe(seconds)
        self._prompt.inc(prompt_tokens)
        self._generated.inc()

    def next_token(self, gap_seconds: float) -> None:
        self._itl.observe(gap_seconds)
        self._token_gap.observe(gap_seconds)
        self._generated.inc()

    def sequence_finished(self, report: SequenceReport) -> None:
        self._e2e.observe(report.e2e_seconds)
        if report.generated_tokens > 1:
            self._tpot.observe(report.decode_seconds / (report.generated_tokens - 1))
        if report.adapter is not None:
            self._metrics.lora_requests.labels(self.name, report.adapter).inc()
        reason = report.finish_reason
        if reason is FinishReason.CANCELLED:
            self._cancelled.inc()
        elif reason is FinishReason.ERROR:
            self._metrics.failures.labels(self.name, report.error_kind.__name__).inc()
        else:
            self._metrics.success.labels(self.name, SUCCESS_REASONS[reason]).inc()
            if report.deadline_cut:
                self._deadline_cuts.inc()

    def step_finished(self, report: StepReport) -> None:
        if report.batch_size:
            self._batch.observe(report.batch_size)
        self._running.set(report.running)
        self._waiting.set(report.waiting)
        if report.prefix_query_tokens != self._seen_queries:
            self._prefix_queries.inc(report.prefix_query_tokens - self._seen_queries)
            self._prefix_hits.inc(report.prefix_hit_tokens - self._seen_hits)
            self._seen_queries, self._seen_hits = report.prefix_query_tokens, report.prefix_hit_tokens
        if report.draft_tokens != self._seen_drafts:
            self._drafts.inc(report.draft_tokens - self._seen_drafts)
            self._accepted.inc(report.accepted_draft_tokens - self._seen_accepted)
            self._seen_drafts, self._seen_accepted = report.draft_tokens, report.accepted_draft_tokens
        self._prefix_bytes.set(report.prefix_cache_bytes)
        self._kv_bytes.set(report.kv_cache_bytes)
