"""A checkpoint's sentence head: token states -> pooled -> Dense layers -> normalised, as it declares.

`SentenceHead` applies a `SentenceConfig` (model/sentence_config.py) to a right-padded batch. Every row
is padded on the right, so a causal model's states for its real tokens equal those of the row alone, and
each mode picks or averages only that row's tokens: the vector of an input does not depend on its batch.
The arithmetic follows sentence-transformers' Pooling, Dense and Normalize modules (the test reference):
`cls` is the first pooled token, `lasttoken` the last, `weightedmean` weighs position p (from 1) by p.

A prompt whose tokens the checkpoint leaves out of pooling (`include_prompt: false`) is given per row
as `prompt_lengths`: those first tokens still reach the transformer (they condition the others) but
no pooling mode reads them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lmi_serve.model.sentence_config import DenseLayer, SentenceConfig


def pool(hidden: torch.Tensor, mask: torch.Tensor, modes: tuple[str, ...],
         prompt_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, width * len(modes)] float32 from `hidden` [rows, T, width] and the right-padded `mask`
    [rows, T]; the first `prompt_lengths[r]` tokens of row r are not pooled."""
    positions = torch.arange(mask.shape[1], device=mask.device)
    keep = mask.bool()
    if prompt_lengths is not None:
        keep &= positions.unsqueeze(0) >= prompt_lengths.unsqueeze(1)
    states = hidden.float()
    weights = keep.unsqueeze(-1).float()
    out = []
    for mode in modes:
        if mode == "cls":
            first = keep.int().argmax(dim=1)
            out.append(states[torch.arange(len(states)), first])
        elif mode == "lasttoken":
            last = torch.where(keep.any(dim=1), mask.shape[1] - 1 - keep.flip(1).int().argmax(dim=1), mask.shape[1] - 1)
            out.append((states * weights)[torch.arange(len(states)), last])
        elif mode == "max":
            out.append(states.masked_fill(~keep.unsqueeze(-1), float("-inf")).max(dim=1).values)
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            count = weights.sum(dim=1).clamp(min=1e-9)
            out.append((states * weights).sum(dim=1) / (count if mode == "mean" else count.sqrt()))
        elif mode == "weightedmean":
            weighted = weights * (positions + 1).float().view(1, -1, 1)
            out.append((states * weighted).sum(dim=1) / weighted.sum(dim=1).clamp(min=1e-9))
        else:
            raise ValueError(f"unknown pooling mode {mode!r}")
    return torch.cat(out, dim=-1)


def _load_state(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(folder / "model.safetensors"))
    return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)


class DenseModule(nn.Module):
    """One sentence-transformers Dense layer with its saved weights (`linear.*`, `residual.weight`)."""

    def __init__(self, spec: DenseLayer):
        super().__init__()
        self.linear = nn.Linear(spec.in_features, spec.out_features, bias=spec.bias)
        self.activation = getattr(nn, spec.activation)()
        self.use_residual = spec.use_residual
        self.residual = (nn.Linear(spec.in_features, spec.out_features, bias=False)
                         if spec.use_residual and spec.in_features != spec.out_features else None)
        missing, unexpected = self.load_state_dict(_load_state(spec.folder), strict=False)
        if missing or unexpected:
            raise ValueError(f"{spec.folder}: Dense weights do not match its config "
                             f"(missing {missing}, unexpected {unexpected})")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.activation(self.linear(x))
        if self.use_residual:
            out = out + (x if self.residual is None else self.residual(x))
        return out


class SentenceHead(nn.Module):
    """Pooling, then the Dense layers (float32); `finish` then normalises where the checkpoint declares it."""

    def __init__(self, config: SentenceConfig, device: torch.device | str = "cpu"):
        super().__init__()
        self.config = config
        self.dense = nn.ModuleList(DenseModule(spec) for spec in config.dense).to(device=device, dtype=torch.float32)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor,
                prompt_lengths: torch.Tensor | None = None) -> torch.Tensor:
        vectors = pool(hidden, mask, self.config.modes, prompt_lengths)
        for layer in self.dense:
            vectors = layer(vectors)
        return vectors


def finish(vector: torch.Tensor, normalize: bool, dimensions: int | None = None) -> torch.Tensor:
    """One vector as served: its first `dimensions` components (Matryoshka truncation), then L2-normalised
    if `normalize` (so a truncated normalised vector is renormalised, as vLLM does)."""
    if dimensions is not None:
        vector = vector[..., :dimensions]
    return nn.functional.normalize(vector, p=2, dim=-1) if normalize else vector
