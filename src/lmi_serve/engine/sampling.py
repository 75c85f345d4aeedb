"""Per-row token choice for a batch whose rows each carry their own SamplingParams.

Order of operations for one step (`HeterogeneousSampler.__call__`):
1. log-softmax of the raw logits: the logprob reported for the chosen token is the model's own.
2. repetition penalty on tokens already seen by that row (only built if some row uses it).
3. greedy rows: argmax of the penalised scores; all greedy rows share one argmax.
4. sampled rows: temperature, top-k, top-p, then one draw per row from that row's own
   `torch.Generator`, so a seeded request gets the same sample whatever else is in the batch.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from .types import SamplingParams


class HeterogeneousSampler:
    def __init__(self, params: Sequence[SamplingParams], device: torch.device, vocab_size: int):
        self.params = list(params)
        self.device = device
        self.vocab_size = vocab_size
        self.generators: list[torch.Generator | None] = []
        for p in self.params:
            if p.do_sample:
                gen = torch.Generator(device="cpu")
                gen.manual_seed(p.seed if p.seed is not None else random.getrandbits(63))
                self.generators.append(gen)
            else:
                self.generators.append(None)
        self._rebuild()

    def _rebuild(self) -> None:
        """Batch tensors of the per-row parameters; called when rows join or leave."""
        rows = self.params
        self.sample_rows = [i for i, p in enumerate(rows) if p.do_sample]
        self.greedy_rows = [i for i, p in enumerate(rows) if not p.do_sample]
        penalties = [p.repetition_penalty for p in rows]
        self.penalty = (torch.tensor(penalties, dtype=torch.float32, device=self.device)[:, None]
                        if any(v != 1.0 for v in penalties) else None)

    def filter(self, keep: Sequence[int]) -> None:
        """Keep only the rows at `keep`, in that order."""
        self.params = [self.params[i] for i in keep]
        self.generators = [self.generators[i] for i in keep]
        self._rebuild()

    @property
    def needs_seen_tokens(self) -> bool:
        return self.penalty is not None

    def __call__(self, logits: torch.Tensor, seen: torch.Tensor | None = None) -> tuple[list[int], list[float]]:
        """Choose one token per row. `seen` is a [rows, vocab] bool mask of prompt + generated tokens,
        required when `needs_seen_tokens`. Returns (token ids, their logprobs)."""
        logits = logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        scores = logits
        if self.penalty is not None and seen is not None:
            penalised = torch.where(scores < 0, scores * self.penalty, scores / self.penalty)
            scores = torch.where(seen, penalised, scores)
        chosen = torch.empty(len(self.params), dtype=torch.long, device=logits.device)
        if self.greedy_rows:
            idx = torch.tensor(self.greedy_rows, device=logits.device)
            chosen[idx] = scores[idx].argmax(dim=-1)
        for row in self.sample_rows:
            chosen[row] = self._sample_row(scores[row], self.params[row], self.generators[row])
        token_ids = chosen.tolist()
        picked = logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
        return token_ids, picked

    @staticmethod
    def _sample_row(scores: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
        scores = scores / max(p.temperature, 1e-5)
        if 0 < p.top_k < scores.shape[-1]:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = sorted_probs.cumsum(-1)
            # Drop a token once the mass before it already reaches top_p; the best token always stays.
            drop_sorted = (cumulative - sorted_probs) >= p.top_p
            drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        return int(torch.multinomial(probs.cpu(), 1, generator=gen).item())
