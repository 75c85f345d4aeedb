"""Attention over a slot cache kept in parts (kv/slots.py): each part's rows attend over that part's
own columns only, so a short row never pays for a long neighbour's columns.

A slot cache whose rows differ a lot in length keeps them in several parts, each a buffer of
consecutive batch rows right-aligned at the batch's column cursor (part p holds the last `len_p`
columns). Its layer `update` then returns `Parts` (one K or V tensor per part) instead of one
tensor, and `parts_attention` runs transformers' SDPA attention once per part, on that part's
queries, K, V and the last `len_p` columns of the batch's mask. For a plain tensor it is exactly
transformers' `sdpa_attention_forward`, except in a decode step without a mask (`decode_attention`).
A packed forward (kv/mixed.py: decode rows and prompt chunks in one sequence) hands it `Packed` K/V
instead, and `packed_attention` attends each side against its own cache.

`use_parts(model)` (called by the decoder-only layouts' `prepare`, kv/dynamic.py, so every KV cache
attends the same way) switches a model whose attention is SDPA, dispatched through transformers'
attention interface, to this function (registered as `ATTENTION`, with SDPA's mask builder); a model
with another attention (eager, or one that tests for "sdpa" by name, such as Falcon) keeps it, and a
slot cache for it stays in one part.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import pack_gqa, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from lmi_serve.kernels.attention import attention_configs as _attention_configs
from lmi_serve.kernels.attention import decode_kernel_applies
from lmi_serve.kernels.cpu import decode_kernel

ATTENTION = "lmi_slot_parts"


class Parts(tuple):
    """Per part, in batch row order, the K (or V) of its columns in use: [rows_p, kv heads, len_p, head dim]."""


class Packed(tuple):
    """A packed forward's K (or V), kv/mixed.py: the decode rows' (a tensor or `Parts`, when the plan
    has rows) then each chunk's row's [1, kv heads, cached + chunk, head dim]; `plan` says where their
    queries are and what each attends over."""

    def __new__(cls, sides, plan):
        packed = super().__new__(cls, sides)
        packed.plan = plan
        return packed


# Keyword arguments that change what SDPA attention computes; with any of them set, transformers' own
# function runs.
_SPECIAL = ("position_bias", "softcap", "s_aux", "sinks", "output_attentions", "cache")


def special_kwargs(kwargs: dict) -> bool:
    return any(kwargs.get(name) is not None and kwargs.get(name) is not False for name in _SPECIAL)


def decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """One query per row (a decode step): the query heads that share a K/V head go as that head's
    queries (transformers' `pack_gqa`), with or without a mask. transformers does this only when
    there is a mask; without one it asks SDPA to broadcast the K/V heads (`enable_gqa`), which took
    0.66 ms where this takes 0.36 (32 rows of 208 tokens, SmolLM2's 9 query and 3 K/V heads).
    fp32 or bf16 on the CPU, kernels/cpu/decode_kernel.py's kernel attends instead (option.decode_attention=auto)."""
    if query.shape[2] != 1 or special_kwargs(kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if not dropout and decode_kernel_applies(module) and decode_kernel.eligible(query, key, value, attention_mask):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = decode_kernel.attend(query, key, value, attention_mask, scale)
        if out is not None:
            return out, None
    groups = getattr(module, "num_key_value_groups", 1)
    packed = pack_gqa(query, groups) if groups > 1 else query
    mask = pack_gqa(attention_mask, groups) if groups > 1 else attention_mask
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)
    return out.reshape(out.shape[0], -1, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: Packed, value: Packed,
                     dropout: float = 0.0, scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """A packed forward's attention (kv/mixed.py): `query` [1, heads, rows + chunk tokens, dim]; the
    decode rows attend as a decode step does, each chunk causally over its own row's K/V; the outputs
    go back in packed order, [1, rows + chunk tokens, heads, dim]."""
    plan = key.plan
    sides = iter(zip(key, value))
    outputs = []
    if plan.rows:
        keys, values = next(sides)
        queries = query[0, :, :plan.rows].transpose(0, 1).unsqueeze(2)  # [rows, heads, 1, dim]
        out, _ = parts_attention(module, queries, keys, values, plan.decode_mask, dropout, scaling, **kwargs)
        outputs.append(out.reshape(1, plan.rows, *out.shape[2:]))
    for (start, end), mask, (keys, values) in zip(plan.spans, plan.chunk_masks, sides):
        out, _ = sdpa_attention_forward(module, query[:, :, start:end], keys, values, mask, dropout, scaling,
                                        **kwargs)
        outputs.append(out)
    return torch.cat(outputs, dim=1), None


def parts_attention(module: torch.nn.Module, query: torch.Tensor, key: Any, value: Any,
                    attention_mask: torch.Tensor | None, *args, **kwargs) -> tuple[torch.Tensor, None]:
    if isinstance(key, Packed):  # the model's mask is a placeholder: the plan holds each side's
        return packed_attention(module, query, key, value, *args, **kwargs)
    if not isinstance(key, Parts):
        return decode_attention(module, query, key, value, attention_mask, *args, **kwargs)
    outputs, start = [], 0
    for part_keys, part_values in zip(key, value):
        end = start + part_keys.shape[0]
        mask = attention_mask
        if mask is not None:  # [batch or 1, 1 or heads, queries, columns]; the part's columns are the last ones
            rows = mask[start:end] if mask.shape[0] > 1 else mask
            mask = rows[..., mask.shape[-1] - part_keys.shape[2]:]
        out, _ = decode_attention(module, query[start:end], part_keys, part_values, mask, *args, **kwargs)
        outputs.append(out)
        start = end
    return torch.cat(outputs), None


AttentionInterface.register(ATTENTION, parts_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def attends_by_parts(model: Any) -> bool:
    """Whether `model` attends with `parts_attention` now (`use_parts` made it so)."""
    if not getattr(model, "_supports_attention_backend", False):
        return False
    return {getattr(c, "_attn_implementation", None) for c in _attention_configs(model)} == {ATTENTION}


def use_parts(model: Any) -> bool:
    """Make an SDPA model attend with `parts_attention` (the same for one tensor); True when the model
    now does (or already did), False when its attention is another one."""
    if not getattr(model, "_supports_attention_backend", False):  # its attention never asks the interface
        return False
    configs = _attention_configs(model)
    implementations = {getattr(c, "_attn_implementation", None) for c in configs}
    if implementations == {ATTENTION}:
        return True
    if not implementations <= {"sdpa", ATTENTION}:
        return False
    for config in configs:
        config._attn_implementation = ATTENTION
    return True
