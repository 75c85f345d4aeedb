"""What N engine replicas (gunicorn workers) of the default store cost in memory: RSS, PSS and USS per worker.

For each kernel layout and each replica count, starts the default store with that many workers, waits until every
worker has loaded every model, sends one short request, lets memory settle, and reads each worker's
/proc/<pid>/smaps_rollup: RSS (what it touches), PSS (shared pages split among their sharers: the sum over the
workers is what they cost together) and USS (Private_Clean + Private_Dirty: what ending it would give back).
`shared` is the layout whose weights stay in the memory-mapped safetensors cache (torch's Linear, no row-kernel
copies): the page cache holds them once however many workers map them. The baseline is 1 replica of the same
layout, in the same run; the workers are not pinned (4 replicas do not fit 2 cores disjointly), as memory does not
depend on it. With `--clients N` each run then times N concurrent requests of `--tokens` tokens (greedy, EOS
ignored) and prints the tokens per second: the speed the layout's memory is traded against (on a box with fewer
cores than replicas the replicas only share the cores: the speed figure that matters there is 1 replica's).

Run: .venv/bin/python -m benchmarks.bench_replicas [--replicas 1,2,4] [--layouts default,shared] [--clients 16]
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from benchmarks.benchmark.common import cpu_summary
from benchmarks.benchmark.suite import helper

helpers = helper("server_process")
ServerProcess, wait_for = helpers.ServerProcess, helpers.wait_for

LAYOUTS = {
    "default": {},
    "shared": {"OPTION_LINEAR_KERNEL": "torch", "OPTION_ROW_KERNEL": "off"},
}
MODELS = 3  # the default store's models: each worker logs "Model <name> ready" once per model
MIB = 1024  # smaps_rollup counts kB


def workers_of(master: int) -> list[int]:
    return [int(pid) for pid in Path(f"/proc/{master}/task/{master}/children").read_text().split()]


def rollup(pid: int) -> dict[str, float]:
    """RSS, PSS and USS of `pid` in MiB, and the anonymous and file-backed parts of its PSS."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, _, value = line.partition(":")
        fields[name.strip()] = int(value.split()[0]) / MIB
    return {"rss": fields["Rss"], "pss": fields["Pss"], "uss": fields["Private_Clean"] + fields["Private_Dirty"],
            "pss_anon": fields.get("Pss_Anon", 0.0), "pss_file": fields.get("Pss_File", 0.0)}


def throughput(server, clients: int, tokens: int) -> float:
    """Tokens per second of `clients` concurrent requests of `tokens` tokens each (all of them generated)."""
    body = {"inputs": "Write a long story about a dragon.",
            "parameters": {"max_new_tokens": tokens, "ignore_eos_token": True, "details": True}}

    def one(_: int) -> int:
        response = requests.post(server.url("/invocations"), json=body, timeout=900)
        response.raise_for_status()
        return response.json()["details"]["generated_tokens"]

    started = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        generated = sum(pool.map(one, range(clients)))
    return generated / (time.monotonic() - started)


def measure(replicas: int, env: dict[str, str], clients: int = 0, tokens: int = 64
            ) -> tuple[list[dict[str, float]], float]:
    server = ServerProcess("--workers", str(replicas), env=env)
    try:
        server.wait_for_ping(timeout=900)
        wait_for(lambda: server.output().count("ready (") >= replicas * MODELS, timeout=900)
        requests.post(server.url("/invocations"), json={"inputs": "The capital of France is",
                                                        "parameters": {"max_new_tokens": 8}},
                      timeout=300).raise_for_status()
        time.sleep(5)  # the collector and the allocator settle; nothing else runs
        workers = [rollup(pid) for pid in workers_of(server.proc.pid)]
        return workers, throughput(server, clients, tokens) if clients else 0.0
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", default="1,2,4")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated: " + ", ".join(LAYOUTS))
    parser.add_argument("--clients", type=int, default=0, help="also time this many concurrent requests (0: no)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per timed request")
    args = parser.parse_args()
    print(cpu_summary())
    print("layout   replicas  per worker RSS / PSS / USS (MiB)                 all workers: PSS (x 1 replica)  USS")
    for layout in args.layouts.split(","):
        baseline = None
        for replicas in (int(n) for n in args.replicas.split(",")):
            started = time.monotonic()
            workers, speed = measure(replicas, LAYOUTS[layout], args.clients, args.tokens)
            pss, uss = sum(w["pss"] for w in workers), sum(w["uss"] for w in workers)
            baseline = baseline or pss
            each = "; ".join(f"{w['rss']:.0f}/{w['pss']:.0f}/{w['uss']:.0f}" for w in workers)
            print(f"{layout:<8} {replicas:>8}  {each:<48} {pss:7.0f} (x{pss / baseline:.2f})  {uss:7.0f}"
                  f"   [PSS anon {sum(w['pss_anon'] for w in workers):.0f}, file "
                  f"{sum(w['pss_file'] for w in workers):.0f}; {time.monotonic() - started:.0f} s]"
                  + (f"  {speed:.1f} tok/s at {args.clients} clients" if speed else ""), flush=True)


if __name__ == "__main__":
    main()
