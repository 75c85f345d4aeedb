"""Per-row token choice for a batch whose rows each carry their own SamplingParams.

Order of operations for one step (`HeterogeneousSampler.__call__`):
1. log-softmax of the raw logits: the logprob reported for a token (chosen or top-n) is the model's own.
2. penalties, only if some row uses them: repetition (prompt + generated tokens, HF semantics),
   then presence and frequency (generated tokens, OpenAI semantics); then logit biases; then the
   token mask (`allowed`: grammars, allowed ids, bans; see token_masks.py), so greedy and sampled
   rows alike obey it.
3. greedy rows: argmax of the penalised scores; all greedy rows share one argmax.
4. sampled rows: temperature, then min-p, typical-p, top-k and top-p masks (each a no-op for rows
   with the neutral value), then one uniform draw per row from that row's own `torch.Generator`,
   inverted through the row's CDF. A seeded request gets the same sample whatever else is in the batch.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from .types import SamplingParams


@dataclass
class SampleOutput:
    """One chosen token per row. The tensors stay on the device (the batch feeds `chosen` to the next
    forward); the Python lists are read once each, when the rows' events are built."""

    chosen: torch.Tensor  # [rows] long: the chosen token ids
    chosen_logprobs: torch.Tensor  # [rows] float: their logprobs
    top_n: list[int]  # per row: how many best alternatives to report
    top_values: torch.Tensor | None = None  # [rows, max(top_n)] logprobs, best first; None when no row asks
    top_ids: torch.Tensor | None = None  # [rows, max(top_n)] their token ids

    @cached_property
    def token_ids(self) -> list[int]:
        return self.chosen.tolist()

    @cached_property
    def logprobs(self) -> list[float]:
        return self.chosen_logprobs.tolist()

    @cached_property
    def top(self) -> list[list[tuple[int, float]]]:
        """Per row: the n best (id, logprob), n from `top_n`."""
        if self.top_ids is None:
            return [[] for _ in self.top_n]
        values, ids = self.top_values.tolist(), self.top_ids.tolist()
        return [list(zip(ids[r][:n], values[r][:n])) for r, n in enumerate(self.top_n)]


def _column(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.float32, device=device)[:, None]


class HeterogeneousSampler:
    def __init__(self, params: Sequence[SamplingParams], device: torch.device, vocab_size: int,
                 top_n: Sequence[int] | None = None, generators: Sequence[torch.Generator | None] | None = None):
        self.params = list(params)
        self.device = device
        self.vocab_size = vocab_size
        self.top_n = list(top_n) if top_n is not None else [0] * len(self.params)
        self.generators = list(generators) if generators is not None else [self._generator(p) for p in self.params]
        self._rebuild()

    @staticmethod
    def _generator(p: SamplingParams) -> torch.Generator | None:
        if not p.do_sample:
            return None
        gen = torch.Generator(device="cpu")
        gen.manual_seed(p.seed if p.seed is not None else random.getrandbits(63))
        return gen

    def _rebuild(self) -> None:
        """Batch tensors of the per-row parameters; called only when rows join or leave."""
        rows, dev = self.params, self.device
        self.sample_rows = [i for i, p in enumerate(rows) if p.do_sample]
        self.greedy_rows = [i for i, p in enumerate(rows) if not p.do_sample]
        self.repetition = _column([p.repetition_penalty for p in rows], dev) \
            if any(p.repetition_penalty != 1.0 for p in rows) else None
        self.presence = _column([p.presence_penalty for p in rows], dev) \
            if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in rows) else None
        self.frequency = _column([p.frequency_penalty for p in rows], dev) if self.presence is not None else None
        sampled = [rows[i] for i in self.sample_rows]
        self.temperature = _column([max(p.temperature, 1e-5) for p in sampled], dev)
        self.top_k = torch.tensor([p.top_k if p.top_k > 0 else self.vocab_size for p in sampled],
                                  dtype=torch.long, device=dev)[:, None]
        self.top_p = _column([p.top_p for p in sampled], dev)
        self.typical_p = _column([p.typical_p for p in sampled], dev) if any(p.typical_p < 1 for p in sampled) else None
        self.min_p = _column([p.min_p for p in sampled], dev) if any(p.min_p > 0 for p in sampled) else None
        self.max_top_n = max(self.top_n, default=0)
        self.bias = None
        if any(p.logit_bias for p in rows):
            self.bias = torch.zeros((len(rows), self.vocab_size), dtype=torch.float32, device=dev)
            for i, p in enumerate(rows):
                for token_id, value in p.logit_bias:
                    if 0 <= token_id < self.vocab_size:
                        self.bias[i, token_id] = value

    @property
    def needs_token_history(self) -> bool:
        return self.repetition is not None or self.presence is not None

    def filter(self, keep: Sequence[int]) -> None:
        """Keep only the rows at `keep`, in that order."""
        self.params = [self.params[i] for i in keep]
        self.generators = [self.generators[i] for i in keep]
        self.top_n = [self.top_n[i] for i in keep]
        self._rebuild()

    def extend(self, other: "HeterogeneousSampler") -> None:
        """Append `other`'s rows after this sampler's (batch concatenation)."""
        self.params += other.params
        self.generators += other.generators
        self.top_n += other.top_n
        self._rebuild()

    def _penalise(self, scores: torch.Tensor, seen: torch.Tensor | None, counts: torch.Tensor | None) -> torch.Tensor:
        if self.repetition is not None and seen is not None:
            penalised = torch.where(scores < 0, scores * self.repetition, scores / self.repetition)
            scores = torch.where(seen, penalised, scores)
        if self.presence is not None and counts is not None:
            counts = counts.to(scores.dtype)
            scores = scores - self.presence * (counts > 0).to(scores.dtype) - self.frequency * counts
        return scores

    def _filtered_sorted(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For the sampled rows: (probabilities sorted descending after all masks, their token ids)."""
        scores = scores / self.temperature
        if self.min_p is not None:
            probs = torch.softmax(scores, dim=-1)
            floor = self.min_p * probs.max(dim=-1, keepdim=True).values
            scores = scores.masked_fill(probs < floor, float("-inf"))
        if self.typical_p is not None:
            scores = self._typical(scores)
        ordered, order = torch.sort(scores, dim=-1, descending=True)
        ranks = torch.arange(ordered.shape[-1], device=ordered.device)[None, :]
        ordered = ordered.masked_fill(ranks >= self.top_k, float("-inf"))
        probs = torch.softmax(ordered, dim=-1)
        # Drop a token once the mass before it already reaches top_p; the best token always stays.
        before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(before >= self.top_p, 0.0)
        return probs, order

    def _typical(self, scores: torch.Tensor) -> torch.Tensor:
        """Locally typical sampling: keep the tokens whose surprise is closest to the entropy."""
        logp = torch.log_softmax(scores, dim=-1)
        p = logp.exp()
        entropy = -(p * torch.nan_to_num(logp, neginf=0.0)).sum(dim=-1, keepdim=True)
        distance = (-logp - entropy).abs()
        order = torch.argsort(distance, dim=-1)
        sorted_p = p.gather(-1, order)
        before = sorted_p.cumsum(dim=-1) - sorted_p
        drop_sorted = before >= self.typical_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        return scores.masked_fill(drop, float("-inf"))

    def __call__(self, logits: torch.Tensor, seen: torch.Tensor | None = None,
                 counts: torch.Tensor | None = None, allowed: torch.Tensor | None = None) -> SampleOutput:
        """Choose one token per row. `seen` ([rows, vocab] bool: prompt + generated tokens) and
        `counts` ([rows, vocab]: generated-token counts) are needed when `needs_token_history`;
        `allowed` ([rows, vocab] bool) masks what a row may not choose now."""
        logits = logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        scores = self._penalise(logits, seen, counts)
        if self.bias is not None:
            scores = scores + self.bias
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        chosen = torch.empty(len(self.params), dtype=torch.long, device=logits.device)
        if self.greedy_rows:
            idx = torch.tensor(self.greedy_rows, device=logits.device)
            chosen[idx] = scores[idx].argmax(dim=-1)
        if self.sample_rows:
            idx = torch.tensor(self.sample_rows, device=logits.device)
            probs, order = self._filtered_sorted(scores[idx])
            # Draw over the vocabulary in token-id order, not in probability order: among 49k tokens
            # many have near-equal scores, and the last-bit differences a different batch makes in
            # the logits reorder them, so a draw in sorted order picked another token for ~1 in 5
            # seeds (a seed replayed alone diverged from the same seed in a batch). In id order the
            # same noise moves each boundary by ~1e-7 of the mass.
            by_id = torch.zeros_like(probs).scatter_(-1, order, probs)
            cdf = by_id.cumsum(dim=-1)
            uniform = torch.stack([torch.rand((), generator=self.generators[r]) for r in self.sample_rows])
            target = (uniform.to(cdf.device)[:, None] * cdf[:, -1:])
            position = torch.searchsorted(cdf, target).clamp(max=cdf.shape[-1] - 1)
            # searchsorted finds the first id whose cumulative mass reaches the target; an id of zero
            # probability cannot be it unless the target is 0 exactly, which is measure zero.
            chosen[idx] = position.squeeze(-1)
        picked = logprobs.gather(1, chosen[:, None]).squeeze(1)
        if not self.max_top_n:
            return SampleOutput(chosen, picked, self.top_n)
        values, ids = torch.topk(logprobs, self.max_top_n, dim=-1)
        return SampleOutput(chosen, picked, self.top_n, values, ids)
