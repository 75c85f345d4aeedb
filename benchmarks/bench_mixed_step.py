"""A joiner's prompt packed into the running rows' decode forward (engine/kv/mixed.py) against the
same work as two forwards (the decode, then the joiner's prefill), in one process, interleaved.

The served default in-process (SmolLM2-135M-Instruct, fp32, Linear layers on oneDNN, the slots KV
cache, the decode kernel), prepared as engine/build.py does. For each row count R and prompt length
T: R running rows whose cache holds --context tokens, and a new prompt of T tokens; "separate" times
`decode()` then `layout.prefill(prompt)`, "mixed" times `decode_with([(empty row, prompt)])`, A, B,
A, B ... over --repeats rounds after warm-up, each on fresh copies of the rows. Printed: min and
median ms of each, the ratio mixed / separate (below 1 the mixed step is faster), the decode step
alone, and the gate: the largest |difference| of every logit and whether every argmax agrees.

    .venv/bin/python -m benchmarks.bench_mixed_step [--batch 1,8,32] [--prompt 20,100,400]
                                                   [--context 200] [--repeats 9]
"""

from __future__ import annotations

import argparse
import time

from benchmarks import bench_step  # noqa: E402


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    parser.add_argument("--batch", type=ints, default=[1, 8, 32])
    parser.add_argument("--prompt", type=ints, default=[20, 100, 400])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    return parser.parse_args(argv)


def timed(call) -> tuple[float, object]:
    start = time.perf_counter()
    out = call()
    return time.perf_counter() - start, out


def measure(model, tokenizer, device, layout, one, rows: int, prompt: list[int], rounds: int, warmup: int):
    """Seconds per round of separate, mixed and decode alone; and the gate's (max |diff|, argmax agree)."""
    times = {"separate": [], "mixed": [], "decode": []}
    worst, agree = 0.0, True
    for round_ in range(warmup + rounds):
        a, b, c = (bench_step.replicate(one, model, tokenizer, rows) for _ in range(3))
        separate, (rows_a, first_a) = timed(lambda: (a.kv.decode(), layout.prefill(
            model, [prompt], pad_id=tokenizer.pad_token_id, device=device).logits))
        mixed, (rows_b, first_b) = timed(lambda: b.kv.decode_with([(layout.empty(model, device), prompt)]))
        decode, _ = timed(c.kv.decode)
        if round_ >= warmup:
            for name, seconds in zip(times, (separate, mixed, decode)):
                times[name].append(seconds)
        worst = max(worst, float((rows_a - rows_b).abs().max()), float((first_a - first_b).abs().max()))
        agree &= bool((rows_a.argmax(-1) == rows_b.argmax(-1)).all()
                      and (first_a.argmax(-1) == first_b.argmax(-1)).all())
    return times, worst, agree


def main(argv=None) -> None:
    args = parse_args(argv)
    served = bench_step.served_row(args.context)
    model, tokenizer, device, layout, one, text_ids = (served.model, served.tokenizer, served.device, served.layout,
                                                       served.one, served.text_ids)
    print(served.header)
    print(f"mixes: {layout.mixes(model)}; running rows hold {args.context} tokens each")
    print(f"\n{'rows':>5} {'prompt':>7} {'separate min':>13} {'mixed min':>10} {'ratio':>6} {'separate med':>13} "
          f"{'mixed med':>10} {'decode alone':>13} {'max |diff|':>11} {'argmax':>7}   (ms)")
    med = lambda xs: sorted(xs)[len(xs) // 2] * 1e3  # noqa: E731
    for rows in args.batch:
        for length in args.prompt:
            prompt = list(bench_step.context_tokens(text_ids[args.context:], length))
            times, worst, agree = measure(model, tokenizer, device, layout, one, rows, prompt, args.repeats,
                                          args.warmup)
            s, m, d = times["separate"], times["mixed"], times["decode"]
            print(f"{rows:>5} {length:>7} {min(s) * 1e3:>13.1f} {min(m) * 1e3:>10.1f} {min(m) / min(s):>6.2f} "
                  f"{med(s):>13.1f} {med(m):>10.1f} {min(d) * 1e3:>13.1f} {worst:>11.2g} "
                  f"{'same' if agree else 'DIFFER':>7}", flush=True)


if __name__ == "__main__":
    main()
