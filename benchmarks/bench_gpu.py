#!/usr/bin/env python3
"""GPU throughput and latency in-process, bf16: the rolling engine (engine/engine.py, slot KV cache) against
transformers' own continuous batching (`init_continuous_batching`, where the installed transformers has
it; "unavailable" otherwise) and a static batch (one padded `model.generate` per C requests), at C
concurrent clients (default 1, 32, 128), closed loop: each client sends its next request when the last
one ended. Reports generated tok/s, TTFT p50, ITL p50, peak GPU memory (`max_memory_allocated`, reset
per point) and the ratio to the rolling engine at the same C; plus the weight-bandwidth ceiling: weight
bytes / the GPU's memory bandwidth (a table by GPU name) = the most tokens per second one sequence can
decode at batch 1. "rolling" runs option.mixed_steps as served (unset: off on a GPU, on on a CPU); `--systems`
may add rolling-mixed and rolling-separate, which set it on (joiners' prompts in the running rows' decode
forward, kv/mixed.py) or off (each step's joiners prefill in a forward of their own); the rolling rows' note
counts the steps that were mixed. Each system is warmed with one request of the workload's
own prompt: warmed with 8 tokens, the first system at each concurrency paid the GPU's first 128-token prefills
in its TTFT p50 (214-339 ms against 34-67 for the same engine run second; docs/gpu.md).

The model is a random-weight Llama of Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads / 8 KV
heads, intermediate 8192, vocab 128256, tied embeddings), built from a config on the GPU: nothing is
downloaded. Prompts are random token ids; the tokenizer is a synthetic word-level one over the same
vocabulary (the engine detokenizes as it streams). Every request generates exactly --new-tokens tokens.

Without CUDA it runs a tiny fp32 model on the CPU ("cpu-tiny"), which checks the script, not the speed.
`scripts/device_check` runs it and puts its rows in its table.

    python -m benchmarks.bench_gpu [--concurrency 1,32,128] [--prompt-tokens 128] [--new-tokens 128]
                                   [--requests-per-client 2] [--json FILE]
                                   [--systems rolling,rolling-mixed,rolling-separate,cb,static]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

LLAMA_3_2_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=8192,
                    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512, max_position_embeddings=1024, tie_word_embeddings=True)
# Peak memory bandwidth by GPU name (vendor figures), for the weight-bandwidth ceiling.
BANDWIDTH_TB_S = [("H200", 4.8), ("H100 PCIe", 2.0), ("H100 NVL", 3.9), ("H100", 3.35), ("GH200", 4.0),
                  ("A100-SXM4-80GB", 2.04), ("A100 80GB PCIe", 1.94), ("A100", 1.56), ("L40S", 0.864),
                  ("L4", 0.3), ("A10G", 0.6), ("A10", 0.6), ("T4", 0.32), ("V100", 0.9)]
SYSTEMS = ("rolling", "cb", "static")


def bandwidth(name: str) -> float | None:
    for key, tb_s in BANDWIDTH_TB_S:
        if key.lower() in name.lower():
            return tb_s
    return None


def synthetic_tokenizer(vocab_size: int):
    """A word-level tokenizer over `vocab_size` tokens "t0".."tN" (0 = pad/eos): no files, no network."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="t0", eos_token="t0", unk_token="t0")


def build_model(shape: dict, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(config).to(dtype)
    model.generation_config.pad_token_id = 0
    return model.eval()


class Clock:
    def __init__(self):
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.tokens = 0
        self.lock = threading.Lock()

    def request(self, started: float, stamps: list[float]) -> None:
        with self.lock:
            self.tokens += len(stamps)
            if stamps:
                self.ttft.append(stamps[0] - started)
                self.itl.extend(b - a for a, b in zip(stamps, stamps[1:]))


def closed_loop(clients: int, requests: list[list[int]], one) -> tuple[Clock, float]:
    """`clients` threads take the next request as soon as their last one ended; `one(prompt, clock)` runs one."""
    clock, lock, queue = Clock(), threading.Lock(), list(enumerate(requests))

    def client():
        while True:
            with lock:
                if not queue:
                    return
                _, prompt = queue.pop(0)
            one(prompt, clock)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return clock, time.perf_counter() - started


def run_rolling(model, tokenizer, device, clients: int, requests, new_tokens: int, mixed: bool | None = None):
    """The rolling engine; `mixed`: option.mixed_steps (None: the served default on `device`, engine/build.py)."""
    from lmi_serve.engine.build import default_mixed_steps
    from lmi_serve.engine.engine import Engine
    from lmi_serve.engine.kv.slots import SLOTS
    from lmi_serve.engine.types import GenerationRequest, SamplingParams, StopParams

    engine = Engine(model, tokenizer, device, kv_layout=SLOTS, max_batch_size=clients,
                    max_queue=len(requests) + 1, max_prefill_tokens=max(512, len(requests[0]) * 4),
                    max_model_len=len(requests[0]) + new_tokens + 8, name="bench-gpu",
                    mixed_steps=default_mixed_steps(device) if mixed is None else mixed).start()

    def one(prompt, clock):
        started, stamps = time.perf_counter(), []
        request = GenerationRequest(tuple(prompt), SamplingParams(), StopParams(max_new_tokens=new_tokens,
                                                                                ignore_eos=True))
        for _ in engine.submit(request):
            stamps.append(time.perf_counter())
        clock.request(started, stamps)

    try:
        one(requests[0], Clock())  # warm-up: the workload's prompt (the docstring)
        result = closed_loop(clients, requests, one)
        stats = engine.stats()
    finally:
        engine.stop()
    return result, f"mixed steps {stats.mixed_steps} of {stats.steps}"


def run_rolling_mixed(model, tokenizer, device, clients: int, requests, new_tokens: int):
    """The rolling engine with option.mixed_steps on: joiners' prompts ride in the running rows' decode forward."""
    return run_rolling(model, tokenizer, device, clients, requests, new_tokens, mixed=True)


def run_rolling_separate(model, tokenizer, device, clients: int, requests, new_tokens: int):
    """The rolling engine with option.mixed_steps off: each step's joiners prefill in a forward of their own."""
    return run_rolling(model, tokenizer, device, clients, requests, new_tokens, mixed=False)


def run_cb(model, tokenizer, device, clients: int, requests, new_tokens: int):
    try:
        from transformers import ContinuousBatchingConfig, GenerationConfig
    except ImportError:
        return None, "unavailable in this transformers"
    if not hasattr(model, "init_continuous_batching"):
        return None, "unavailable in this transformers"
    page = 64
    blocks = clients * (-(-(len(requests[0]) + new_tokens) // page) + 1) + 8
    cb_config = ContinuousBatchingConfig(page_size=page, num_blocks=blocks, max_batch_tokens=max(512, clients * 4),
                                         max_requests_per_batch=clients)
    gen = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb_config)
    manager.start()
    waiting: dict[str, tuple[threading.Event, list]] = {}
    lock = threading.Lock()
    stop = threading.Event()

    def reader():  # one thread reads every streamed result and hands it to its client
        while not stop.is_set():
            result = manager.get_result(timeout=0.5)
            if result is None:
                continue
            with lock:
                entry = waiting.get(result.request_id)
            if entry is not None:
                entry[1].append((time.perf_counter(), len(result.generated_tokens), result.is_finished()))
                if result.is_finished():
                    entry[0].set()

    counter = iter(range(10**9))

    def one(prompt, clock):
        rid, done, seen = f"r{next(counter)}", threading.Event(), []
        with lock:
            waiting[rid] = (done, seen)
        started = time.perf_counter()
        manager.add_request(list(prompt), request_id=rid, max_new_tokens=new_tokens, streaming=True,
                            eos_token_id=-1)
        if not done.wait(600):
            raise RuntimeError("continuous batching stalled")
        stamps, count = [], 0
        for stamp, n, _ in seen:
            stamps.extend([stamp] * (n - count))
            count = max(count, n)
        clock.request(started, stamps)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        one(requests[0], Clock())  # warm-up: the workload's prompt (the docstring)
        result = closed_loop(clients, requests, one)
    finally:
        stop.set()
        manager.stop(block=True, timeout=30)
    return result, f"attn={getattr(model.config, '_attn_implementation', '?')}"


def run_static(model, tokenizer, device, clients: int, requests, new_tokens: int):
    clock = Clock()

    def generate(rows):
        width = max(len(r) for r in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(rows):
            ids[j, width - len(r):] = torch.tensor(r, device=device)
            mask[j, width - len(r):] = 1
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, pad_token_id=0)

    generate([requests[0]])  # warm-up: the workload's prompt (the docstring)
    started = time.perf_counter()
    for first in range(0, len(requests), clients):
        rows = requests[first:first + clients]
        begun = time.perf_counter()
        generate(rows)
        sync(device)
        ended = time.perf_counter()
        for _ in rows:  # not streamed: every token arrives at the end
            clock.request(begun, [ended] * new_tokens)
        clock.ttft[-len(rows):] = [ended - begun] * len(rows)
        del clock.itl[-len(rows) * (new_tokens - 1):]
    return (clock, time.perf_counter() - started), "not streamed: TTFT = the batch's whole generate"


RUNNERS = {"rolling": run_rolling, "rolling-mixed": run_rolling_mixed, "rolling-separate": run_rolling_separate,
           "cb": run_cb, "static": run_static}


def plain_sdpa(model) -> None:
    """transformers' own SDPA attention again (the engine sets `lmi_slot_parts`, kv/slot_attention.py)."""
    from lmi_serve.engine.kv.slot_attention import _attention_configs

    for config in _attention_configs(model):
        config._attn_implementation = "sdpa"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ms(values: list[float]) -> float | None:
    return round(statistics.median(values) * 1000, 2) if values else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,32,128")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--json", help="write the rows and the header here")
    p.add_argument("--cpu-tiny", action="store_true", help="the tiny fp32 CPU variant (chosen anyway without CUDA)")
    args = p.parse_args(argv)

    import transformers

    cuda = torch.cuda.is_available() and not args.cpu_tiny
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    shape, dtype, label = (LLAMA_3_2_1B, torch.bfloat16, "llama-3.2-1b-shape bf16") if cuda else \
        (TINY, torch.float32, "cpu-tiny fp32 (dry run: checks the script, not a GPU figure)")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    if not cuda:
        concurrency = [c for c in concurrency if c <= 4] or [1]
        concurrency = sorted({1, 4} | set(concurrency))
        args.new_tokens, args.prompt_tokens = min(args.new_tokens, 8), min(args.prompt_tokens, 16)
    gpu = torch.cuda.get_device_name(0) if cuda else "none (CPU)"
    model = build_model(shape, device, dtype)
    tokenizer = synthetic_tokenizer(shape["vocab_size"])
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    tb_s = bandwidth(gpu) if cuda else None
    ceiling = (tb_s * 1e12 / weights) if tb_s else None
    header = {"model": label, "gpu": gpu, "torch": torch.__version__, "transformers": transformers.__version__,
              "weights_bytes": weights, "bandwidth_tb_s": tb_s,
              "ceiling_tok_s_batch1": round(ceiling, 1) if ceiling else None,
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens}
    print(json.dumps(header), flush=True)
    generator = torch.Generator().manual_seed(1)
    rows = []
    for clients in concurrency:
        n = clients * args.requests_per_client
        requests = torch.randint(10, shape["vocab_size"], (n, args.prompt_tokens), generator=generator).tolist()
        base = None
        for system in args.systems.split(","):
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            if system != "rolling":  # the engine made the model attend with its own SDPA wrapper: undo that
                plain_sdpa(model)
            try:
                result, note = RUNNERS[system](model, tokenizer, device, clients, requests, args.new_tokens)
            except Exception as exc:  # noqa: BLE001 - one system failing must not hide the others' rows
                result, note = None, f"failed: {type(exc).__name__}: {exc}"[:300]
            row = {"system": system, "clients": clients, "requests": n, "note": note}
            if result is not None:
                clock, wall = result
                tok_s = clock.tokens / wall
                base = tok_s if system == "rolling" else base
                row.update(tok_s=round(tok_s, 1), x_rolling=round(tok_s / base, 2) if base else None,
                           ttft_p50_ms=ms(clock.ttft), itl_p50_ms=ms(clock.itl), tokens=clock.tokens,
                           peak_gpu_mib=round(torch.cuda.max_memory_allocated() / 2**20) if cuda else None)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"header": header, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
