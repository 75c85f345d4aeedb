"""/metrics on a real server with two gunicorn workers: known traffic moves every counter by exactly
that much, the histograms count it, and both workers' values add up (multiprocess mode). The two
workers are engine replicas (option.engine_replicas=2, server/cpu_replicas.py): each pinned to its own
half of the CPUs, both answering through the one port.

Traffic goes to whichever worker accepts it; the sums must be exact all the same. Every wait is a
poll of /metrics with a deadline (server_process.wait_for), never a sleep."""

from __future__ import annotations

import json
import os
import signal
import socket

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from lmi_serve.__main__ import DEFAULT_STORE
from server_process import ServerProcess, wait_for

pytestmark = pytest.mark.integration

LLM = "smollm2-135m-instruct"
PROMPT = "Write a long story about a dragon."
TOKENS = 4
P = "lmi_serve:"


@pytest.fixture(scope="module")
def server():
    # The layout whose weights stay in the memory-mapped cache file, so the replicas share them (and no
    # row-kernel copies to make: seconds of start-up)
    server = ServerProcess("--model-dir", str(DEFAULT_STORE / LLM), env={
        "OPTION_ENGINE_REPLICAS": "2", "OPTION_LINEAR_KERNEL": "torch", "OPTION_ROW_KERNEL": "off"})
    try:
        server.wait_for_ping()
        # /ping answers once one worker is ready; the other may still load (its count comes with it).
        wait_for(lambda: total(scrape(server), P + "model_loads_total") == 2, timeout=300)
        yield server
    finally:
        server.stop()


def scrape(server) -> dict[tuple[str, frozenset], float]:
    response = requests.get(server.url("/metrics"), timeout=30)
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def total(samples, name: str, **labels) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and wanted <= lab)


def delta(before, after, name: str, **labels) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


def idle(server) -> bool:
    samples = scrape(server)
    return total(samples, P + "num_requests_running") == 0 and total(samples, P + "num_requests_waiting") == 0


def complete(server) -> dict:
    body = {"model": LLM, "prompt": PROMPT, "max_tokens": TOKENS, "ignore_eos": True}
    response = requests.post(server.url("/v1/completions"), json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def test_known_traffic_moves_the_counters_by_exactly_that(server):
    before = scrape(server)
    usages = [complete(server) for _ in range(3)]
    bad = requests.post(server.url("/generate"), json={"inputs": "Hi", "parameters": {"max_new_tokens": -1}},
                        timeout=60)
    assert 400 <= bad.status_code < 500, bad.text
    wait_for(lambda: idle(server))  # the gauges follow the engine's step reports
    after = scrape(server)

    requests_total = P + "http_requests_total"
    assert delta(before, after, requests_total) == 4  # scrapes of /metrics are not counted
    assert delta(before, after, requests_total, model_name=LLM, dialect="openai", route="/v1/completions",
                 status_class="2xx") == 3
    assert delta(before, after, requests_total, dialect="tgi", route="/generate", status_class="4xx") == 1
    assert delta(before, after, P + "request_errors_total") == 1

    assert all(u["completion_tokens"] == TOKENS for u in usages)
    assert delta(before, after, P + "prompt_tokens_total", model_name=LLM) == sum(u["prompt_tokens"] for u in usages)
    assert delta(before, after, P + "generation_tokens_total", model_name=LLM) == 3 * TOKENS
    assert delta(before, after, P + "request_success_total", model_name=LLM, finished_reason="length") == 3
    for histogram, count in [("time_to_first_token_seconds", 3), ("e2e_request_latency_seconds", 3),
                             ("request_queue_time_seconds", 3),
                             ("request_time_per_output_token_seconds", 3),
                             ("inter_token_latency_seconds", 3 * (TOKENS - 1)),
                             ("time_per_output_token_seconds", 3 * (TOKENS - 1))]:
        name = P + histogram
        assert delta(before, after, name + "_count", model_name=LLM) == count, histogram
        assert delta(before, after, name + "_bucket", model_name=LLM, le="+Inf") == count, histogram
        assert delta(before, after, name + "_sum", model_name=LLM) > 0, histogram
    assert delta(before, after, P + "batch_size_count", model_name=LLM) >= TOKENS - 1  # at least one decode a token
    assert delta(before, after, P + "request_cancelled_total") == 0
    assert delta(before, after, P + "generation_failures_total") == 0


def send_long_request(server) -> socket.socket:
    """A completion of 2,000 tokens (minutes on a CPU) on a raw socket, which the test closes."""
    body = json.dumps({"model": LLM, "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def test_a_client_that_leaves_is_counted_cancelled(server):
    prompt_tokens = complete(server)["prompt_tokens"]
    wait_for(lambda: idle(server))
    before = scrape(server)
    sock = send_long_request(server)
    try:
        wait_for(lambda: total(scrape(server), P + "num_requests_running") == 1, timeout=120)
    finally:
        sock.close()
    wait_for(lambda: delta(before, scrape(server), P + "request_cancelled_total", model_name=LLM) == 1, timeout=120)
    wait_for(lambda: idle(server))
    after = scrape(server)
    assert delta(before, after, P + "request_cancelled_total", model_name=LLM) == 1
    assert delta(before, after, P + "e2e_request_latency_seconds_count", model_name=LLM) == 1
    assert delta(before, after, P + "prompt_tokens_total", model_name=LLM) == prompt_tokens
    assert delta(before, after, P + "request_success_total") == 0
    assert delta(before, after, P + "generation_failures_total") == 0


def test_two_workers_add_up(server):
    """Each worker loaded the model once and counted it in its own file; /metrics, answered by either
    worker, shows both (and the load time gauge of the live workers)."""
    for _ in range(4):  # whichever worker answers, the sum is the same
        samples = scrape(server)
        assert total(samples, P + "model_loads_total", model_name=LLM) == 2
        assert total(samples, P + "model_load_time_seconds", model_name=LLM) > 0


def test_two_replicas_pinned_to_their_own_cpus_answer_through_one_port(server):
    """Each replica runs on its own contiguous half of the launcher's CPUs (the kernel's affinity, as the
    worker set it), and GET /models/<m> from either says which half answered: both do, on one port."""
    master = server.proc.pid
    pids = [int(pid) for pid in open(f"/proc/{master}/task/{master}/children").read().split()]
    cpus = sorted(os.sched_getaffinity(master))
    half = len(cpus) // 2
    assert sorted(sorted(os.sched_getaffinity(pid)) for pid in pids) == [cpus[:len(cpus) - half], cpus[-half:]]
    seen: dict[tuple[int, ...], dict] = {}
    for _ in range(200):  # a fresh connection each: whichever worker accepts it answers
        shown = requests.get(server.url(f"/models/{LLM}"), timeout=30).json()[0]["models"][0]["cpuThreads"]
        seen[tuple(shown["coreSet"])] = shown
        if len(seen) == 2:
            break
    assert sorted(seen) == [tuple(cpus[:len(cpus) - half]), tuple(cpus[-half:])]
    assert all(shown["replicas"] == 2 and shown["threadsPerWorker"] == shown["threads"] // 2 for shown in seen.values())
    assert "Engine replicas: 2 (option.engine_replicas=2)" in server.output()
    # One copy of the weights: the cache file's pages are resident in both and shared by them
    weights = [safetensors_pages(pid) for pid in pids]
    assert all(rss > 100 * 2**10 and shared > 0.9 * rss for rss, shared in weights), weights


def safetensors_pages(pid: int) -> tuple[int, int]:
    """kB of `pid`'s memory-mapped .safetensors files: resident, and of that shared with another process."""
    rss = shared = 0
    mapped = False
    for line in open(f"/proc/{pid}/smaps").read().splitlines():
        words = line.split()
        if "-" in words[0] and not words[0].endswith(":"):  # a mapping's header: range, perms, ..., path
            mapped = words[-1].endswith(".safetensors")
        elif mapped and words[0] == "Rss:":
            rss += int(words[1])
        elif mapped and words[0] in ("Shared_Clean:", "Shared_Dirty:"):
            shared += int(words[1])
    return rss, shared


def worker_pids(server) -> list[int]:
    return [int(line.rsplit(" ", 1)[1]) for line in server.output().splitlines() if "Booting worker with pid" in line]


def test_dead_workers_counts_stay_and_their_gauges_go(server):
    """Both workers killed outright while one runs a request: gunicorn starts two more (which load
    the model: 4 loads), the dead ones' counts stay in the sums, and their live gauges leave them
    (the launcher's child_exit hook marks them dead), so nothing shows as running."""
    sock = send_long_request(server)
    try:
        wait_for(lambda: total(scrape(server), P + "num_requests_running") == 1, timeout=120)
        before = scrape(server)
        pids = worker_pids(server)
        assert len(pids) == 2, pids
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
    finally:
        sock.close()

    def replaced() -> bool:
        try:
            return total(scrape(server), P + "model_loads_total", model_name=LLM) == 4
        except requests.ConnectionError:  # no worker listening yet
            return False

    wait_for(replaced, timeout=300)
    after = scrape(server)
    assert total(after, P + "http_requests_total") == total(before, P + "http_requests_total")
    assert total(after, P + "request_success_total") == total(before, P + "request_success_total")
    assert total(after, P + "num_requests_running") == 0
    assert complete(server)["completion_tokens"] == TOKENS  # and the server serves on
