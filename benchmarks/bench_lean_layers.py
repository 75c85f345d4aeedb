"""Lean decoder layers (kernels/layers/lean_layers.py) against transformers' own forward, on one model in one process.

The served default in-process (SmolLM2-135M-Instruct, fp32, Linear layers on oneDNN stacked, the slots KV
cache, the decode kernel), as engine/build.py prepares it. The same model is timed both ways by switching
its layers' forward between steps: two separately loaded models differ by their weights' placement in
memory, which moved a decode step by ±5 % on this box, more than the change measured. For each row count:
two copies of R rows whose cache holds --context tokens, one decoded by lean layers and one by
transformers' forward, in turns (the order flipped every round), --repeats rounds after warm-up. Printed:
min and median ms of each, the ratio lean / transformers (below 1 the lean layers are faster), and the gate:
whether both copies chose the same tokens at every step (their logits are the same bits: tests hold that).

    .venv/bin/python -m benchmarks.bench_lean_layers [--batch 1,8,32] [--context 200] [--repeats 40]
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks import bench_step  # noqa: E402


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=lambda text: [int(x) for x in text.split(",")], default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    return parser.parse_args(argv)


class Switch:
    """Turns the model's lean layers (instance `forward`s) off and on again."""

    def __init__(self, model):
        self.lean = {layer: vars(layer)["forward"] for layer in model.modules() if "forward" in vars(layer)}

    def set(self, on: bool) -> None:
        for layer, forward in self.lean.items():
            if on:
                layer.forward = forward
            else:
                vars(layer).pop("forward", None)


def main(argv=None) -> None:
    args = parse_args(argv)
    served = bench_step.served_row(args.context)
    model, tokenizer, one = served.model, served.tokenizer, served.one
    switch = Switch(model)
    print(served.header)
    print(f"lean layers: {len(switch.lean)}; rows hold {args.context} tokens each")
    print(f"\n{'rows':>5} {'hf min':>8} {'lean min':>9} {'ratio':>6} {'hf med':>8} {'lean med':>9} {'ratio':>6} "
          f"{'tokens':>7}   (ms)")
    for rows in args.batch:
        batches = {on: bench_step.replicate(one, model, tokenizer, rows) for on in (False, True)}
        times = {False: [], True: []}
        same = True
        for round_ in range(args.warmup + args.repeats):
            for on in ((False, True) if round_ % 2 else (True, False)):
                switch.set(on)
                start = time.perf_counter()
                batches[on].decode()
                elapsed = time.perf_counter() - start
                batches[on].sample()
                if round_ >= args.warmup:
                    times[on].append(elapsed)
            same &= batches[False].history.seen.equal(batches[True].history.seen)
        switch.set(True)
        hf, lean = times[False], times[True]
        print(f"{rows:>5} {min(hf) * 1e3:>8.2f} {min(lean) * 1e3:>9.2f} {min(lean) / min(hf):>6.3f} "
              f"{statistics.median(hf) * 1e3:>8.2f} {statistics.median(lean) * 1e3:>9.2f} "
              f"{statistics.median(lean) / statistics.median(hf):>6.3f} {'same' if same else 'DIFFER':>7}", flush=True)


if __name__ == "__main__":
    main()
