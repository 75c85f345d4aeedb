"""What the slot KV cache (engine/kv/slots.py) spends when rows leave and join a running batch, in one process
per checkout, the served default in-process (SmolLM2-135M fp32, one part):

- keep: 32 rows of --context tokens, one leaves (`eviction_order` + `keep`: the last row takes its place);
- join: 31 such rows that a longer row (+100 tokens) shared until it left (so the window starts past
  column 0, as after any longest row leaves), and a joiner of 100 tokens merging into their part.

Each operation on fresh rows, --repeats times; printed: min and median ms. With --baseline-tree DIR (another
checkout of this repository, e.g. a `git worktree` of an older commit) the same measurement runs on DIR's code
in a subprocess, alternating with this tree's, and the ratios this / baseline are printed.

    .venv/bin/python -m benchmarks.bench_slot_moves [--context 150] [--repeats 9] [--baseline-tree DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=2, help="with --baseline-tree: alternations of the two")
    parser.add_argument("--baseline-tree", type=Path)
    parser.add_argument("--tree", type=Path, default=ROOT, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def load_bench_step(tree: Path) -> types.ModuleType:
    """`tree`'s benchmarks/bench_step.py as a module of its own (this tree's or the baseline's)."""
    name = "bench_step_of_tree"
    spec = importlib.util.spec_from_file_location(name, tree / "benchmarks" / "bench_step.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def measure(tree: Path, context: int, repeats: int) -> dict[str, list[float]]:
    """Seconds of each operation, `repeats` times, with `tree`'s code (its lmi_serve comes first on
    PYTHONPATH: run_worker puts it there)."""
    bench_step = load_bench_step(tree)
    import torch

    import lmi_serve.engine.kv.slots as slots

    slots.SlotKV.merge_slack = 10**9  # one part: rows of similar lengths, as a served batch's end up
    served = bench_step.served_row(context)
    model, tokenizer, device, layout, one = served.model, served.tokenizer, served.device, served.layout, served.one
    joiner = tuple(bench_step.context_tokens(served.text_ids[context:], 100))
    longer = tuple(bench_step.context_tokens(served.text_ids, context + 100))
    times: dict[str, list[float]] = {"keep": [], "join": []}
    for _ in range(repeats):
        batch = bench_step.replicate(one, model, tokenizer, 32)
        order = batch.kv.eviction_order([i for i in range(32) if i != 7])
        start = time.perf_counter()
        batch.kv.keep(order)
        times["keep"].append(time.perf_counter() - start)

        batch = bench_step.replicate(one, model, tokenizer, 31)
        batch.kv.extend(layout.prefill(model, [longer], pad_id=tokenizer.pad_token_id, device=device).kv)
        batch.kv.feed(torch.tensor([5] * 32))
        batch.kv.decode()
        batch.kv.keep(list(range(31)))  # the longer row leaves
        new = layout.prefill(model, [joiner], pad_id=tokenizer.pad_token_id, device=device).kv
        start = time.perf_counter()
        batch.kv.extend(new)
        times["join"].append(time.perf_counter() - start)
    return times


def run_worker(tree: Path, context: int, repeats: int) -> dict[str, list[float]]:
    command = [sys.executable, "-m", "benchmarks.bench_slot_moves", "--worker", "--tree", str(tree),
               "--context", str(context), "--repeats", str(repeats)]
    path = os.pathsep.join(p for p in (str(tree / "src"), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": path})
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(measure(args.tree, args.context, args.repeats)))
        return
    trees = {"this tree": args.tree.resolve()}
    if args.baseline_tree:
        trees["baseline"] = args.baseline_tree.resolve()
    times: dict[str, dict[str, list[float]]] = {name: {"keep": [], "join": []} for name in trees}
    for _ in range(args.rounds if args.baseline_tree else 1):
        for name, tree in trees.items():
            for operation, seconds in run_worker(tree, args.context, args.repeats).items():
                times[name][operation] += seconds
    ms = lambda xs: (min(xs) * 1e3, sorted(xs)[len(xs) // 2] * 1e3)  # noqa: E731
    print(f"32 rows of {args.context} tokens; ms (min / median)")
    for operation in ("keep", "join"):
        cells = [f"{name} {ms(t[operation])[0]:.2f} / {ms(t[operation])[1]:.2f}" for name, t in times.items()]
        ratio = (f"; this / baseline {min(times['this tree'][operation]) / min(times['baseline'][operation]):.2f}x"
                 if args.baseline_tree else "")
        print(f"{operation}: {'; '.join(cells)}{ratio}")


if __name__ == "__main__":
    main()
