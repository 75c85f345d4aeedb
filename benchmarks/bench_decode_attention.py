"""The decode step with kernels/cpu/decode_kernel.py's attention against torch's SDPA, in one process, interleaved.

The served default in-process (SmolLM2-135M-Instruct, fp32, Linear layers on oneDNN, the slots KV cache,
prepared as engine/build.py does): for each context length and row count, rows whose cache holds that
many tokens decode one step with the kernel, then one step with SDPA (the kernel switched off), A, B,
A, B ... over --repeats rounds after warm-up; min and median ms per step, the ratio kernel / SDPA
(below 1 the kernel is faster) and the time in attention alone per step. Then a gate: greedy tokens of
batched prompts with the kernel equal those with SDPA.

    .venv/bin/python -m benchmarks.bench_decode_attention [--batch 1,4,8,32] [--context 200,800,2000]
                                                         [--repeats 15]
"""

from __future__ import annotations

import argparse
import time

from benchmarks import bench_step  # noqa: E402
import torch  # noqa: E402
from benchmarks.benchmark.common import cpu_summary  # noqa: E402
from benchmarks.benchmark.step_quality import PERPLEXITY_TEXT  # noqa: E402

from lmi_serve.engine.kv import slot_attention  # noqa: E402
from lmi_serve.kernels.cpu import decode_kernel  # noqa: E402


class Switch:
    """Turns the kernel off (decode_kernel.attend returns None: SDPA attends) and counts attention time."""

    def __init__(self):
        self.on, self.seconds = True, 0.0
        self._attend, self._decode = decode_kernel.attend, slot_attention.decode_attention
        decode_kernel.attend = lambda *a: self._attend(*a) if self.on else None
        slot_attention.decode_attention = self._timed

    def _timed(self, *args, **kwargs):
        start = time.perf_counter()
        out = self._decode(*args, **kwargs)
        self.seconds += time.perf_counter() - start
        return out


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    parser.add_argument("--batch", type=ints, default=[1, 4, 8, 32])
    parser.add_argument("--context", type=ints, default=[200, 800, 2000])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    return parser.parse_args(argv)


def time_pair(batch, switch: Switch, rounds: int, warmup: int) -> dict[bool, tuple[list[float], float]]:
    times = {True: [], False: []}
    attention = {True: 0.0, False: 0.0}
    for round_ in range(warmup + rounds):
        for on in (True, False):
            switch.on, switch.seconds = on, 0.0
            start = time.perf_counter()
            batch.decode()
            elapsed = time.perf_counter() - start
            batch.sample()
            if round_ >= warmup:
                times[on].append(elapsed)
                attention[on] += switch.seconds
    return {on: (times[on], attention[on] / rounds) for on in times}


def greedy_gate(model, tokenizer, device, layout, switch: Switch, tokens: int = 32) -> str:
    from lmi_serve.engine.batch import Batch, make_row
    from lmi_serve.engine.types import GenerationRequest, SamplingParams, StopParams
    from benchmarks.benchmark.suite import helper
    PROMPTS = helper("engine_prompts").PROMPTS

    prompts = [tokenizer(text).input_ids for text in PROMPTS[:8]]
    stop = StopParams(max_new_tokens=tokens, ignore_eos=True)
    outputs = {}
    for on in (True, False):
        switch.on = on
        rows = [make_row(GenerationRequest(tuple(p), SamplingParams(), stop), tokenizer) for p in prompts]
        batch = Batch.prefill(model, rows, tokenizer.pad_token_id, device, layout)
        generated = [[] for _ in prompts]
        for _ in range(tokens):
            for i, token in enumerate(batch.sample().chosen.tolist()):
                generated[i].append(token)
            batch.decode()
        outputs[on] = generated
    same = sum(a == b for a, b in zip(outputs[True], outputs[False]))
    return f"greedy gate: {same}/{len(prompts)} batched continuations of {tokens} tokens identical, kernel vs SDPA"


def main(argv=None) -> None:
    args = parse_args(argv)
    model, tokenizer, device, layout, line = bench_step.served_default()
    switch = Switch()
    print(f"cpu: {cpu_summary()}\ntorch {torch.__version__}, {torch.get_num_threads()} threads; {line}")
    print(f"kernel available: {decode_kernel.kernel() is not None}")
    text_ids = tokenizer(PERPLEXITY_TEXT.read_text()).input_ids
    print(f"\n{'rows':>5} {'KV':>6} {'kernel min':>11} {'SDPA min':>9} {'ratio':>6} {'kernel med':>11} "
          f"{'SDPA med':>9} {'attn kernel':>12} {'attn SDPA':>10}   (ms per step)")
    for context in args.context:
        one = bench_step.prefill_one(model, tokenizer, device, layout, bench_step.context_tokens(text_ids, context))
        for rows in args.batch:
            batch = bench_step.replicate(one, model, tokenizer, rows)
            result = time_pair(batch, switch, args.repeats, args.warmup)
            (kt, ka), (st, sa) = result[True], result[False]
            med = lambda xs: sorted(xs)[len(xs) // 2] * 1e3  # noqa: E731
            print(f"{rows:>5} {context:>6} {min(kt) * 1e3:>11.1f} {min(st) * 1e3:>9.1f} {min(kt) / min(st):>6.2f} "
                  f"{med(kt):>11.1f} {med(st):>9.1f} {ka * 1e3:>12.1f} {sa * 1e3:>10.1f}", flush=True)
            del batch
    print(greedy_gate(model, tokenizer, device, layout, switch))


if __name__ == "__main__":
    main()
