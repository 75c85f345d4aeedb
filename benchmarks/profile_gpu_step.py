"""Where one decode step's time goes at batch 1 on a GPU (docs/gpu.md, "Where the step goes").

Three figures on the same model (benchmarks/bench_gpu.py's Llama-3.2-1B shape in bf16, random weights),
in one run:
- `engine`: the rolling engine's inter-token time for one request (SLOTS layout), median;
- `forward`: transformers' own forward of one token with a DynamicCache, synchronised, median, i.e. the
  floor any server on eager transformers pays per step;
- `kernels`: the GPU time per step the profiler sees (sum of CUDA kernel time / steps).
Then torch.profiler's table of the engine's steps, by self CPU time, so the host side is named.

    python -m benchmarks.profile_gpu_step [--steps 48] [--cpu-tiny]

Without CUDA it runs the tiny CPU shape (a check of the script, not a figure).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from benchmarks.bench_gpu import LLAMA_3_2_1B, TINY, build_model, plain_sdpa, sync, synthetic_tokenizer  # noqa: E402


def engine_itl(model, tokenizer, device, prompt: list[int], steps: int):
    """(median inter-token time on the engine's own thread, the profiler over the same steps driven
    on this thread: torch.profiler records the thread that started it)."""
    from lmi_serve.engine.engine import Engine
    from lmi_serve.engine.kv.slots import SLOTS
    from lmi_serve.engine.types import GenerationRequest, SamplingParams, StopParams

    engine = Engine(model, tokenizer, device, kv_layout=SLOTS, max_batch_size=4, max_queue=4,
                    max_prefill_tokens=512, max_model_len=len(prompt) + steps + 8, name="profile")

    def request():
        return GenerationRequest(tuple(prompt), SamplingParams(), StopParams(max_new_tokens=steps, ignore_eos=True))

    def run_threaded():
        stamps = [time.perf_counter() for _ in engine.submit(request())]
        return [b - a for a, b in zip(stamps, stamps[1:])]

    engine.start()
    try:
        run_threaded()  # warm-up: allocator, cuBLAS handles, the slot buffers
        gaps = run_threaded()
    finally:
        engine.stop()

    # The same request with the scheduler stepped here, under the profiler.
    engine = Engine(model, tokenizer, device, kv_layout=SLOTS, max_batch_size=4, max_queue=4,
                    max_prefill_tokens=512, max_model_len=len(prompt) + steps + 8, name="profile-sync")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    engine.submit(request())
    while not engine.scheduler.idle:  # warm-up on this thread
        engine.scheduler.step()
    engine.submit(request())
    with torch.profiler.profile(activities=activities) as prof:
        while not engine.scheduler.idle:
            engine.scheduler.step()
        sync(device)
    return statistics.median(gaps), prof


def forward_step(model, device, prompt: list[int], steps: int) -> float:
    from transformers import DynamicCache

    plain_sdpa(model)  # the engine made the model attend through its slot wrapper: transformers' own SDPA again
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        cache = DynamicCache()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            sync(device)
            started = time.perf_counter()
            out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            sync(device)
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--cpu-tiny", action="store_true")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu_tiny
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    shape, dtype = (LLAMA_3_2_1B, torch.bfloat16) if cuda else (TINY, torch.float32)
    model = build_model(shape, device, dtype)
    tokenizer = synthetic_tokenizer(shape["vocab_size"])
    prompt = torch.randint(10, shape["vocab_size"], (128,), generator=torch.Generator().manual_seed(1)).tolist()

    itl, prof = engine_itl(model, tokenizer, device, prompt, args.steps)
    forward = forward_step(model, device, prompt, args.steps)
    events = prof.key_averages()
    # Kernels only: an aten op's row repeats the time of the kernels it launched.
    kernel_us = sum(e.self_device_time_total for e in events if str(e.device_type).endswith("CUDA")) if cuda else 0
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernelEx"))
    label = torch.cuda.get_device_name(0) if cuda else "CPU (tiny shape: a check of the script)"
    print(f"# {label}, torch {torch.__version__}, batch 1, {len(prompt)} prompt tokens, {args.steps} steps")
    print(f"engine ITL p50   {itl * 1000:8.2f} ms")
    print(f"forward p50      {forward * 1000:8.2f} ms  (transformers' forward of one token, DynamicCache)")
    if cuda:
        print(f"kernels / step   {kernel_us / 1000 / args.steps:8.2f} ms  (profiled GPU time over the steps)")
        print(f"launches / step  {launches / args.steps:8.0f}")
    print(f"engine - forward {(itl - forward) * 1000:8.2f} ms  (sampling, bookkeeping, the host read)")
    print()
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    if cuda:
        print(events.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
