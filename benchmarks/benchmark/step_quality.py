"""The quality gates of benchmarks/bench_step.py: what a faster KV implementation must not change.

(a) greedy agreement: fixed prompts, generated alone and batched with each KV implementation,
    compared token by token with `dynamic` alone (an exact implementation scores 100 %);
(b) perplexity on a fixed English text (perplexity.txt, next to this file): plain transformers
    forward (the reference) against each implementation's prefill with prompt logits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from lmi_serve.engine.batch import Batch, make_row
from lmi_serve.engine.kv.protocol import KVLayout
from lmi_serve.engine.types import GenerationRequest, SamplingParams, StopParams

PERPLEXITY_TEXT = Path(__file__).with_name("perplexity.txt")


def greedy_tokens(model, tokenizer, device, layout: KVLayout, prompts: Sequence[Sequence[int]], n: int
                  ) -> list[list[int]]:
    """`n` greedy tokens (EOS ignored) for each of `prompts`, prefilled together in one batch and
    decoded by the engine's own Batch, as the scheduler does."""
    rows = [make_row(GenerationRequest(tuple(p), SamplingParams(), StopParams(max_new_tokens=n, ignore_eos=True)),
                     tokenizer) for p in prompts]
    batch = Batch.prefill(model, rows, tokenizer.pad_token_id, device, layout)
    batch.emit(batch.sample())
    while not all(row.finished for row in batch.rows):  # every row has the same length: no evictions
        batch.decode()
        batch.emit(batch.sample())
    return [row.token_ids for row in batch.rows]


@dataclass(frozen=True)
class Agreement:
    matching: int  # positions equal to the reference's
    positions: int
    identical_rows: int
    rows: int

    @property
    def percent(self) -> float:
        return 100.0 * self.matching / self.positions

    def __str__(self) -> str:
        return (f"{self.percent:6.2f} % of tokens ({self.matching}/{self.positions}), "
                f"{self.identical_rows}/{self.rows} rows identical")


def agreement(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> Agreement:
    """Position-by-position agreement of two sets of token rows of equal shape."""
    matching = sum(a == b for ref, row in zip(reference, other) for a, b in zip(ref, row))
    positions = sum(len(ref) for ref in reference)
    identical = sum(list(ref) == list(row) for ref, row in zip(reference, other))
    return Agreement(matching, positions, identical, len(reference))


def greedy_gate(model, tokenizer, device, layouts: dict[str, KVLayout], prompts: Sequence[Sequence[int]],
                n: int) -> list[str]:
    """Lines of gate (a): per implementation, alone and batched, against `dynamic` alone."""
    reference = [greedy_tokens(model, tokenizer, device, layouts["dynamic"], [p], n)[0] for p in prompts]
    lines = []
    for name, layout in layouts.items():
        alone = reference if name == "dynamic" else [
            greedy_tokens(model, tokenizer, device, layout, [p], n)[0] for p in prompts]
        batched = greedy_tokens(model, tokenizer, device, layout, prompts, n)
        lines.append(f"  {name:<10} alone:   {agreement(reference, alone)}")
        lines.append(f"  {name:<10} batched: {agreement(reference, batched)}")
    return lines


def perplexity(logits: torch.Tensor, ids: Sequence[int]) -> float:
    """exp(mean negative log-likelihood) of ids[1:], given `logits` [len(ids), vocab] of every position."""
    target = torch.tensor(ids[1:], dtype=torch.long, device=logits.device)
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), target)
    return math.exp(float(nll))


def perplexity_gate(model, tokenizer, device, layouts: dict[str, KVLayout]) -> list[str]:
    """Lines of gate (b): the reference forward, then each implementation's prefill."""
    ids = tokenizer(PERPLEXITY_TEXT.read_text()).input_ids
    with torch.inference_mode():
        reference = perplexity(model(input_ids=torch.tensor([ids], device=device)).logits[0], ids)
    lines = [f"  {'reference':<10} {reference:9.4f}   ({len(ids)} tokens, plain transformers forward)"]
    for name, layout in layouts.items():
        out = layout.prefill(model, [ids], pad_id=tokenizer.pad_token_id, device=device, prompt_logits=True)
        value = perplexity(out.prompt_logits[0], ids)
        lines.append(f"  {name:<10} {value:9.4f}   ({value / reference - 1:+.2e} relative)")
    return lines


PERPLEXITY_BUDGET = 0.05  # a lighter-weights variant passes gate (b) within +5 % of fp32's perplexity
DECODE_PPL_TOKENS = 300  # gate (b) one token a forward: the decode kernels' perplexity on the text's head


def quantize_gates(reference, variants: dict[str, object], tokenizer, device, layout: KVLayout,
                   prompts: Sequence[Sequence[int]], n: int, ppl_tokens: int | None) -> list[str]:
    """Lines of both gates for option.quantize variants against the fp32 `reference` model:
    (a) greedy continuations alone, identical to fp32's (n/N), and each variant batched against
    itself alone (batch invariance); (b) perplexity of the first `ppl_tokens` tokens of the text
    (plain forward), with its verdict: within +5 % of fp32's."""
    ids = tokenizer(PERPLEXITY_TEXT.read_text()).input_ids[:ppl_tokens]

    def ppl(model) -> float:
        with torch.inference_mode():
            return perplexity(model(input_ids=torch.tensor([ids], device=device)).logits[0], ids)

    def decode_ppl(model) -> float:
        """The same text one token a forward (a decode step's row count: the few-row kernels, where a
        variant has its own; the plain forward above runs many rows)."""
        from transformers import DynamicCache

        head = ids[:DECODE_PPL_TOKENS]
        cache, logits = DynamicCache(), []
        with torch.inference_mode():
            for token in head:
                out = model(input_ids=torch.tensor([[token]], device=device), past_key_values=cache, use_cache=True)
                logits.append(out.logits[0, -1].float())
        return perplexity(torch.stack(logits), head)

    def verdict(value: float, base: float) -> str:
        return "PASS" if value <= base * (1 + PERPLEXITY_BUDGET) else "FAIL"

    base_ppl, base_decode = ppl(reference), decode_ppl(reference)
    base = [greedy_tokens(reference, tokenizer, device, layout, [p], n)[0] for p in prompts]
    lines = [f"  {'fp32':<6} perplexity {base_ppl:9.4f} ({len(ids)} tokens); one token a forward "
             f"{base_decode:9.4f} (the first {min(len(ids), DECODE_PPL_TOKENS)})"]
    for name, model in variants.items():
        value, decoded = ppl(model), decode_ppl(model)
        alone = [greedy_tokens(model, tokenizer, device, layout, [p], n)[0] for p in prompts]
        batched = greedy_tokens(model, tokenizer, device, layout, prompts, n)
        same = agreement(base, alone)
        lines.append(f"  {name:<6} perplexity {value:9.4f} ({value / base_ppl - 1:+.2%}) {verdict(value, base_ppl)} "
                     f"(gate: within +{PERPLEXITY_BUDGET:.0%} of fp32)")
        lines.append(f"  {name:<6} one token a forward {decoded:9.4f} ({decoded / base_decode - 1:+.2%}) "
                     f"{verdict(decoded, base_decode)} (the same gate)")
        lines.append(f"  {name:<6} greedy vs fp32: {same.identical_rows}/{same.rows} identical continuations "
                     f"({same.percent:.1f} % of tokens, {n} tokens each)")
        lines.append(f"  {name:<6} batched vs alone (batch invariance): {agreement(alone, batched)}")
    return lines
