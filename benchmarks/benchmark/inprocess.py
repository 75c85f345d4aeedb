"""In-process systems (transformers CB, static batch), each run in a subprocess: `bench.py --_worker KIND`."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from .common import BENCH_MODULE, RESULT_TAG, ROOT, ModelSource
from .monitor import Monitor, tree_cpu
from .stats import summarize
from .workload import Workload


def run_worker(kind: str, spec_path: str) -> dict:
    spec = json.loads(Path(spec_path).read_text())
    import resource

    import torch

    torch.set_num_threads(spec["threads"])
    from lmi_serve.model.loader import load_generation_model

    lm = load_generation_model(spec["model_id"], gguf_file=spec["gguf_file"])
    model, tok = lm.model, lm.tokenizer
    workload = Workload(spec["prompts"], spec["prompt_tokens"], spec["max_new_tokens"])
    ids = [tok(p).input_ids for p in workload.prompts]
    run = worker_cb if kind == "cb" else worker_static
    result = run(model, tok, ids, workload, spec)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def worker_cb(model, tok, ids: list[list[int]], workload: Workload, spec: dict) -> dict:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    concurrency, n_req = spec["concurrency"], spec["num_requests"]
    longest = max(len(ids[workload.request(k)[0]]) + workload.request(k)[2] for k in range(n_req))
    page = 64
    num_blocks = concurrency * (math.ceil(longest / page) + 1) + 4
    cb_config = ContinuousBatchingConfig(page_size=page, num_blocks=num_blocks, max_batch_tokens=512,
                                         max_requests_per_batch=concurrency)
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(workload.max_new_tokens),
                                  eos_token_id=-1, pad_token_id=tok.pad_token_id)
    mgr = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config)
    mgr.start()
    try:
        # warm-up: one short request, waited for
        rid = mgr.add_request(ids[0], request_id="warmup", max_new_tokens=4, streaming=False, eos_token_id=-1)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            res = mgr.get_result(timeout=1)
            if res is not None and res.request_id == rid and res.is_finished():
                break
        state: dict[str, dict] = {}
        records: list[dict] = []
        next_k = 0

        def submit() -> None:
            nonlocal next_k
            k = next_k
            next_k += 1
            i, _, n = workload.request(k)
            rid = f"r{k}"
            state[rid] = {"k": k, "ok": False, "error": None, "tokens": 0, "target": n, "ttft": None, "itl": [],
                          "streamed": True, "start": time.perf_counter(), "last": None}
            mgr.add_request(ids[i], request_id=rid, max_new_tokens=n, streaming=True, eos_token_id=-1)

        started = time.perf_counter()
        for _ in range(min(concurrency, n_req)):
            submit()
        idle_since = time.monotonic()
        while len(records) < n_req:
            res = mgr.get_result(timeout=1)
            if res is None:
                if time.monotonic() - idle_since > 300 or not mgr.is_running():
                    raise RuntimeError(f"continuous batching stalled after {len(records)}/{n_req} requests")
                continue
            idle_since = time.monotonic()
            now = time.perf_counter()
            st = state.get(res.request_id)
            if st is None or "e2e" in st:
                continue
            n_tok = len(res.generated_tokens)
            if n_tok > st["tokens"]:
                if st["last"] is None:
                    st["ttft"] = now - st["start"]
                else:
                    st["itl"].append(now - st["last"])
                st["last"], st["tokens"] = now, n_tok
            if res.is_finished():
                st["e2e"] = now - st["start"]
                st["error"] = res.error
                st["ok"] = res.error is None
                records.append(st)
                if next_k < n_req:
                    submit()
        wall = max(r["start"] + r["e2e"] for r in records) - started
    finally:
        mgr.stop(block=True, timeout=30)
    notes = [(f"cb: ContinuousBatchingConfig(page_size={page}, num_blocks={num_blocks}, max_batch_tokens=512, "
              f"max_requests_per_batch={concurrency}), per-request max_new_tokens, eos_token_id=-1, "
              f"attn={getattr(model.config, '_attn_implementation', '?')}")]
    return {"records": sorted(records, key=lambda r: r["k"]), "wall": wall, "notes": notes}


def worker_static(model, tok, ids: list[list[int]], workload: Workload, spec: dict) -> dict:
    import torch

    batch, n_req = spec["concurrency"], spec["num_requests"]
    pad = tok.pad_token_id

    def generate(rows: list[list[int]], new_tokens: int) -> None:
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, r in enumerate(rows):
            input_ids[j, width - len(r):] = torch.tensor(r)
            mask[j, width - len(r):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=pad)
        assert out.shape[1] == width + new_tokens, out.shape

    generate([ids[0], ids[1]], 4)  # warm-up
    records, raw_tokens, wall = [], 0, 0.0
    for first in range(0, n_req, batch):
        ks = list(range(first, min(first + batch, n_req)))
        rows = [ids[workload.request(k)[0]] for k in ks]
        targets = [workload.request(k)[2] for k in ks]
        longest = max(targets)
        start = time.perf_counter()
        generate(rows, longest)
        took = time.perf_counter() - start
        for k, n in zip(ks, targets):
            # every row of the batch returns when the longest one is done
            records.append({"k": k, "ok": True, "error": None, "tokens": n, "target": n, "ttft": took, "e2e": took,
                            "streamed": False, "start": start})
        raw_tokens += longest * len(ks)
        wall += took
    notes = [f"static: {math.ceil(n_req / batch)} padded generate() call(s) of up to {batch} rows, back to back"]
    return {"records": records, "wall": wall, "raw_tokens": raw_tokens, "notes": notes}


def run_inprocess(kind: str, workload: Workload, concurrency: int, num_requests: int, threads: int,
                  workdir: Path, server_pids: list[int], source: ModelSource) -> tuple[dict, list[str]]:
    spec = {"prompts": workload.prompts, "prompt_tokens": workload.prompt_tokens,
            "max_new_tokens": workload.max_new_tokens, "concurrency": concurrency, "num_requests": num_requests,
            "threads": threads, "model_id": source.model_id, "gguf_file": source.gguf_file}
    spec_path = workdir / f"{kind}-{concurrency}.json"
    spec_path.write_text(json.dumps(spec))
    log_path = workdir / f"{kind}-{concurrency}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", BENCH_MODULE, "--_worker", kind, "--_spec", str(spec_path)],
                                stdout=subprocess.PIPE, stderr=err, env=env, cwd=ROOT, text=True)
        # the servers idle meanwhile; bg CPU counts neither them nor the worker
        servers_before = sum(tree_cpu(p) for p in server_pids)
        try:
            with Monitor(proc.pid) as mon:
                stdout, _ = proc.communicate()
        except BaseException:  # interrupted (bench.py's SIGINT/SIGTERM): the worker must not outlive us
            proc.kill()
            proc.wait()
            raise
        servers_cpu = sum(tree_cpu(p) for p in server_pids) - servers_before
    lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{kind} worker failed (rc {proc.returncode}):\n{tail}")
    result = json.loads(lines[-1][len(RESULT_TAG):])
    extra = {"peak_rss_mib": result["peak_rss_mib"], "bg_cpu": mon.bg_cpu_percent, "idle_servers_cpu_s": servers_cpu}
    if "raw_tokens" in result:
        extra["raw_tok_s"] = result["raw_tokens"] / result["wall"]
    return summarize(kind, concurrency, result["records"], result["wall"], extra), result.get("notes", [])


def inproc_point(kind: str, workload: Workload, concurrency: int, num_requests: int, threads: int, workdir: Path,
                 server_pids: list[int], notes_out: list[str], source: ModelSource) -> dict:
    row, notes = run_inprocess(kind, workload, concurrency, num_requests, threads, workdir, server_pids, source)
    notes_out.extend(notes)
    return row
