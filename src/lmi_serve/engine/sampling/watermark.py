"""Watermarked rows (Kirchenbauer et al., "A Watermark for Large Language Models"), with transformers'
own `WatermarkLogitsProcessor`, so transformers' `WatermarkDetector` finds the mark.

At every step a watermarked row adds `delta` to the logits of a "green list": a `gamma` share of
the vocabulary drawn by a generator seeded with the hashing key times the row's previous token
(transformers' "lefthash" scheme, context width 1). Each row is seeded from its own previous token
(its last generated token, at the first step its last prompt token), so a row's green lists do not
depend on the batch, and a seeded or greedy request reproduces its output. The bias reaches the
sampler as one [rows, vocab] tensor (zero for unmarked rows), added with the logit biases; reported
logprobs stay the model's own.

Defaults are TGI's (gamma 0.5, delta 2.0); `option.watermark_gamma` / `option.watermark_delta` change
them. The key is transformers' default, which its detector also uses by default. The processor's
tables take ~0.2-0.8 s to build, so the model's handler builds one `Watermark` and passes it to its
Engine (an Engine made without one refuses watermarked requests).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

HASHING_KEY = 15485863  # transformers' default (the millionth prime)


@dataclass(frozen=True)
class WatermarkSettings:
    gamma: float = 0.5  # the green list's share of the vocabulary (transformers' greenlist_ratio)
    delta: float = 2.0  # added to a green token's logit (transformers' bias)
    hashing_key: int = HASHING_KEY

    def detector_config(self) -> dict:
        """The `watermarking_config` transformers' WatermarkDetector needs to find this mark."""
        return {"greenlist_ratio": self.gamma, "bias": self.delta, "hashing_key": self.hashing_key,
                "seeding_scheme": "lefthash", "context_width": 1}


class Watermark:
    """One model's watermark: the processor every watermarked row of its engine uses (its tables
    are built once; the engine's step thread is its only caller)."""

    def __init__(self, vocab_size: int, device: torch.device, settings: WatermarkSettings = WatermarkSettings()):
        from transformers.generation.logits_process import WatermarkLogitsProcessor

        self.settings = settings
        self.vocab_size = vocab_size
        self._processor = WatermarkLogitsProcessor(vocab_size, device, **settings.detector_config())

    def green_bias(self, previous: Sequence[int], width: int, device: torch.device) -> torch.Tensor:
        """[len(previous), width]: `delta` on each row's green list given its previous token, else 0."""
        scores = torch.zeros((len(previous), min(width, self.vocab_size)), dtype=torch.float32, device=device)
        ids = torch.tensor([[t] for t in previous], dtype=torch.long, device=device)
        biased = self._processor(ids, scores)  # seeds its generator from each row's own previous token
        if width > self.vocab_size:  # logits wider than the vocabulary: the padding is never green
            biased = torch.nn.functional.pad(biased, (0, width - self.vocab_size))
        return biased


def watermark_bias(rows, width: int, device: torch.device) -> torch.Tensor | None:
    """The [rows, width] bias of a batch's watermarked rows (`Row.watermark` set), or None when no
    row is watermarked, so an unmarked batch pays nothing."""
    marked = [i for i, row in enumerate(rows) if row.watermark is not None]
    if not marked:
        return None
    bias = torch.zeros((len(rows), width), dtype=torch.float32, device=device)
    for i in marked:
        row = rows[i]
        previous = row.token_ids[-1] if row.token_ids else row.request.prompt_ids[-1]
        bias[i] = row.watermark.green_bias([previous], width, device)[0]
    return bias
