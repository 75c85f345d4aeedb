"""Embeddings batched across requests: sentences/s of single-sentence /v1/embeddings clients against the
same model's in-process ceiling, in one run.

- ceiling   the built-in handler's EmbeddingService.embed (tokenize, forward, pool) in this process, on the
            same sentences, at batch sizes 1..64; the best batch size's sentences/s is the ceiling
- served    the real server (`python -m lmi_serve --model-dir`, the embedded all-MiniLM-L6-v2 and its
            default batching), closed loop: each client posts one sentence per request to /v1/embeddings
            and posts the next as soon as its reply came back; 1 and 16 clients
- unbatched (--unbatched) the same server with option.batch_size=1: every request its own forward (what
            the embedding model did before it batched by default)
Prints sentences/s, the ratio to the ceiling, and the server's batch counters (GET /models/<m>), and where
the CPU went: CPU ms per sentence of the ceiling (this process), and per request of the server's worker
and of the benchmark's own clients (this process's threads; on a small machine they share the server's
cores). At the ceiling's rate a sentence leaves (cores / ceiling) CPU-seconds for everything, so the
clients' and the server's CPU per request above the ceiling's bound the ratio a run can reach.
The ceiling runs before the server starts and again (at its best batch size) after it stopped, so the
two never share the CPU; the ratios use the higher of the two, and the gap between them shows how much
the machine's load moved during the run.

    .venv/bin/python -m benchmarks.bench_embeddings [--clients 1,16] [--seconds 15] [--unbatched]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

from benchmarks.bench_openai import start_server  # noqa: E402
from benchmarks.soak import worker_pid  # noqa: E402
from benchmarks.benchmark.common import cpu_summary  # noqa: E402

MODEL = "all-minilm-l6-v2"
PROPERTIES = Path(__file__).resolve().parents[1] / "src/lmi_serve/serving/defaults" / MODEL / "serving.properties"
SUBJECTS = ["The cat", "A small company", "My neighbour", "The new library", "This old bridge", "Our team",
            "The weather service", "A local farmer"]
VERBS = ["opened", "repaired", "described", "announced", "questioned", "painted", "measured", "celebrated"]
OBJECTS = ["the door before sunrise", "a plan for the winter months", "the results of the latest survey",
           "an unusual pattern in the river", "the price of fresh bread", "a short story about the sea"]


def sentences(n: int = 256) -> list[str]:
    """`n` distinct single sentences of 7–14 words, the same every run."""
    out = []
    for i in range(n):
        s, v, o = SUBJECTS[i % 8], VERBS[(i // 8) % 8], OBJECTS[(i // 64 + i) % 6]
        out.append(f"{s} {v} {o}" + (f" on day {i}." if i % 3 else "."))
    return out


def embedding_service():
    from lmi_serve.config.sources import ModelConfig
    from lmi_serve.serving.handlers.embeddings import EmbeddingService

    model_id = next(line.split("=", 1)[1].strip() for line in PROPERTIES.read_text().splitlines()
                    if line.startswith("option.model_id="))
    return EmbeddingService(ModelConfig(name=MODEL, model_id=model_id, task="text-embedding"))


def own_cpu() -> float:
    """CPU seconds (user + system) of this process, every thread."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process `pid`, from /proc (clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ceiling(service, texts: list[str], batch_sizes: list[int], seconds: float,
            cpu_ms: dict[int, float] | None = None) -> dict[int, float]:
    """Sentences/s of the built-in handler's embed() per batch size, in this process (and, into `cpu_ms`,
    the CPU milliseconds per sentence)."""
    rates = {}
    for size in batch_sizes:
        service.embed(texts[:size])  # warm-up: this shape's kernels
        done, start, i, cpu = 0, time.perf_counter(), 0, own_cpu()
        while time.perf_counter() - start < seconds:
            batch = [texts[(i + k) % len(texts)] for k in range(size)]
            service.embed(batch)
            done, i = done + size, i + size
        rates[size] = done / (time.perf_counter() - start)
        if cpu_ms is not None:
            cpu_ms[size] = 1000 * (own_cpu() - cpu) / done
    return rates


def served(base: str, texts: list[str], clients: int, seconds: float) -> tuple[float, int]:
    """(sentences/s, failed requests) of `clients` closed-loop clients, one sentence per request."""
    stop, counts, errors = time.perf_counter() + seconds, [0] * clients, [0] * clients

    def client(c: int) -> None:
        session, i = requests.Session(), c
        while time.perf_counter() < stop:
            resp = session.post(f"{base}/v1/embeddings", json={"model": MODEL, "input": texts[i % len(texts)]},
                                timeout=60)
            if resp.status_code == 200 and len(resp.json()["data"]) == 1:
                counts[c] += 1
            else:
                errors[c] += 1
            i += clients

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - start), sum(errors)


def run_server(port: int, extra: list[str], texts: list[str], client_counts: list[int], seconds: float) -> list[dict]:
    folder = Path(tempfile.mkdtemp(prefix="lmi-bench-emb-")) / MODEL
    folder.mkdir()
    (folder / "serving.properties").write_text(PROPERTIES.read_text() + "".join(f"{p}\n" for p in extra))
    proc = start_server(port, "--model-dir", str(folder), log_prefix="lmi-bench-embeddings-")
    base = f"http://127.0.0.1:{port}"
    rows = []
    try:
        served(base, texts, 4, 2.0)  # warm-up
        for clients in client_counts:
            before = requests.get(f"{base}/models/{MODEL}", timeout=10).json()[0]["models"][0]["batchStats"]
            worker = worker_pid(proc.pid)
            server_cpu, client_cpu = process_cpu(worker), own_cpu()
            rate, failed = served(base, texts, clients, seconds)
            server_cpu, client_cpu = process_cpu(worker) - server_cpu, own_cpu() - client_cpu
            entry = requests.get(f"{base}/models/{MODEL}", timeout=10).json()[0]["models"][0]
            after = entry["batchStats"]
            batches, reqs = after["batches"] - before["batches"], after["requests"] - before["requests"]
            served_requests = after["requests"] - before["requests"]
            rows.append({"clients": clients, "rate": rate, "failed": failed, "batch_size": entry["batchSize"],
                         "server_cpu_ms": 1000 * server_cpu / max(served_requests, 1),
                         "client_cpu_ms": 1000 * client_cpu / max(served_requests, 1),
                         "delay": entry["maxBatchDelayMillis"], "mean_batch": reqs / max(batches, 1),
                         "largest": after["largestBatch"]})
    finally:
        proc.terminate()
        proc.wait(30)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", default="1,16")
    p.add_argument("--batch-sizes", default="1,8,16,32,64", help="in-process batch sizes for the ceiling")
    p.add_argument("--seconds", type=float, default=15.0, help="per measured point (default 15)")
    p.add_argument("--unbatched", action="store_true", help="also the server with option.batch_size=1")
    p.add_argument("--option", action="append", default=[], help="more serving.properties lines, e.g. "
                   "option.max_batch_delay=5")
    p.add_argument("--port", type=int, default=8393)
    args = p.parse_args()
    texts = sentences()
    client_counts = [int(x) for x in args.clients.split(",")]
    print(f"CPU: {cpu_summary()}")
    service = embedding_service()
    cpu_ms: dict[int, float] = {}
    rates = ceiling(service, texts, [int(x) for x in args.batch_sizes.split(",")], args.seconds / 3, cpu_ms)
    best = max(rates, key=rates.get)
    print("in-process: " + ", ".join(f"batch {b}: {r:.1f}/s ({cpu_ms[b]:.2f} CPU ms/sentence)"
                                     for b, r in rates.items()) +
          f"; ceiling {rates[best]:.1f} sentences/s at batch {best}")
    results = []
    systems = {"served (defaults)": args.option}
    if args.unbatched:
        systems["served batch_size=1"] = [*args.option, "option.batch_size=1"]
    for name, extra in systems.items():
        results += [(name, row) for row in run_server(args.port, extra, texts, client_counts, args.seconds)]
    after = ceiling(service, texts, [best], args.seconds / 3)[best]
    top = max(rates[best], after)
    print(f"ceiling again after the servers: {after:.1f} sentences/s at batch {best}; ratios use {top:.1f}")
    print(f"CPU ms per sentence in-process at batch {best}: {cpu_ms[best]:.2f}; at the ceiling's rate a sentence "
          f"leaves {1000 * os.cpu_count() / top:.2f} CPU ms for everything ({os.cpu_count()} cores)")
    print("| system | clients | sentences/s | x ceiling | batch_size / delay ms | mean batch | largest since start "
          "| server CPU ms/request | client CPU ms/request | failed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, row in results:
        print(f"| {name} | {row['clients']} | {row['rate']:.1f} | {row['rate'] / top:.2f} | "
              f"{row['batch_size']} / {row['delay']} | {row['mean_batch']:.1f} | {row['largest']} | "
              f"{row['server_cpu_ms']:.2f} | {row['client_cpu_ms']:.2f} | {row['failed']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
