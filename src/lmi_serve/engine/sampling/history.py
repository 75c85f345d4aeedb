"""A batch's sampling state: the per-row sampler and the token history its penalties read.

Row i of `seen`, `counts` and `sampler` is the batch's row i; `keep` and `extend` mirror the KV
batch's verbs (kv/protocol.py), so the two halves always describe the same rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmi_serve.engine.sampling.sampler import HeterogeneousSampler, SampleOutput
from lmi_serve.engine.types import GenerationRequest


@dataclass
class SamplingHistory:
    seen: torch.Tensor  # [rows, vocab] bool: prompt + generated tokens (repetition penalty)
    counts: torch.Tensor  # [rows, vocab] int: generated-token counts (presence/frequency)
    sampler: HeterogeneousSampler

    @classmethod
    def start(cls, requests: Sequence[GenerationRequest], vocab: int, device: torch.device,
              seen: Sequence[Sequence[int]] | None = None) -> "SamplingHistory":
        """New rows that have seen `seen` (by default their prompts) and generated nothing yet."""
        contexts = [tuple(s) for s in seen] if seen is not None else [tuple(r.prompt_ids) for r in requests]
        width = max(len(c) for c in contexts)
        # Short contexts repeat their last token on the left, so only real tokens are marked.
        index = torch.tensor([(c[-1],) * (width - len(c)) + c for c in contexts], dtype=torch.long, device=device)
        seen = torch.zeros((len(requests), vocab), dtype=torch.bool, device=device)
        seen.scatter_(1, index, True)
        sampler = HeterogeneousSampler([r.sampling for r in requests], device, vocab,
                                       top_n=[r.top_n_tokens for r in requests])
        return cls(seen, torch.zeros((len(requests), vocab), dtype=torch.int32, device=device), sampler)

    def choose(self, logits: torch.Tensor, allowed: torch.Tensor | None,
               bias: torch.Tensor | None = None) -> SampleOutput:
        """Each row's next token from `logits` ([rows, vocab]) under the `allowed` mask, with this
        step's extra `bias` (watermarks); not yet recorded."""
        history = self.sampler.needs_token_history
        return self.sampler(logits, self.seen if history else None, self.counts if history else None, allowed,
                            bias)

    def record(self, tokens: torch.Tensor) -> None:
        """Count each row's chosen token ([rows], on the device)."""
        self.seen.scatter_(1, tokens[:, None], True)
        self.counts.scatter_add_(1, tokens[:, None], torch.ones_like(self.counts[:, :1]))

    def keep(self, indices: Sequence[int]) -> None:
        index = torch.tensor(list(indices), dtype=torch.long, device=self.seen.device)
        self.seen, self.counts = self.seen[index], self.counts[index]
        self.sampler.filter(indices)

    def extend(self, other: "SamplingHistory") -> None:
        self.seen = torch.cat([self.seen, other.seen])
        self.counts = torch.cat([self.counts, other.counts])
        self.sampler.extend(other.sampler)
