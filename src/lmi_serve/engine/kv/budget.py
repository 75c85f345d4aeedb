"""The KV memory budget on a GPU (`option.gpu_memory_utilization`): how many tokens of K/V the rolling
batch may hold, decided once at start-up, after the model is loaded and warmed up.

    budget   = gpu_memory_utilization × total device memory
               − memory in use now (total − free, as `torch.cuda.mem_get_info` says, after emptying
                 torch's cache: the weights, the warm-up's leftovers, other processes)
               − an activation reserve for one prefill of `max_rolling_batch_prefill_tokens` tokens
                 and one decode of `max_rolling_batch_size` rows (`activation_reserve`)
    capacity = budget // K/V bytes per token (every layer's K and V of one token, `kv_bytes_per_token`)

The scheduler (scheduler.py) then admits a request only when the tokens it may reach (prompt +
max_new_tokens, capped at the context) fit what the running rows have not reserved; otherwise it
waits at the head of the queue. A request that could not fit even alone is refused when submitted.
On a CPU there is no budget (None): kv/select.py checks the slot bound against host memory, as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default


@dataclass(frozen=True)
class KVBudget:
    """What start-up decided: `tokens` of K/V the rolling batch may reserve, and how it was reached."""

    tokens: int  # the capacity: K/V tokens all running rows together may reserve
    bytes_per_token: int
    total_bytes: int  # the device's memory
    in_use_bytes: int  # in use after loading and warming up
    reserve_bytes: int  # kept for activations
    utilization: float

    @property
    def kv_bytes(self) -> int:
        return self.tokens * self.bytes_per_token

    def describe(self, max_model_len: int, rows: int) -> str:
        gib = 2**30
        return (f"Memory budget: {self.utilization:g} x {self.total_bytes / gib:.1f} GiB - "
                f"{self.in_use_bytes / gib:.1f} GiB in use - {self.reserve_bytes / gib:.2f} GiB activation reserve = {self.kv_bytes / gib:.2f} GiB "
                f"for K/V: {self.tokens} tokens at {self.bytes_per_token / 1024:.1f} KiB/token, "
                f"{self.tokens // max_model_len} rows at the full {max_model_len}-token context "
                f"(option.max_rolling_batch_size={rows})")


def _text_config(model: Any) -> Any:
    config = model.config
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config


def _element_size(model: Any) -> int:
    return next(model.parameters()).element_size()


def kv_bytes_per_token(model: Any, layout: Any) -> int:
    """K/V bytes one token takes: the layout's own bound for 1 row × 1 column where it declares one
    (slots), else every decoder layer's K and V from the model's config (the same arithmetic)."""
    declared = layout.memory_bytes(model, 1, 1)
    if declared:
        return int(declared)
    config = _text_config(model)
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "num_decoder_layers", None) \
        or getattr(config, "num_layers", 0)
    attention = getattr(config, "num_attention_heads", None) or getattr(config, "num_heads", 1)
    heads = getattr(config, "num_key_value_heads", None) or attention
    head_dim = getattr(config, "head_dim", None) or getattr(config, "d_kv", None) \
        or getattr(config, "hidden_size", getattr(config, "d_model", 0)) // attention
    return max(1, 2 * layers * heads * head_dim * _element_size(model))


def activation_reserve(model: Any, *, prefill_tokens: int, rows: int) -> int:
    """An estimate of the activations of the largest step: a prefill of `prefill_tokens` tokens (hidden
    states, the MLP's intermediate, a few copies of each) and fp32 logits for every prefill position
    and every decode row (prompt logprobs ask for every position; sampling copies a row's logits)."""
    config = _text_config(model)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "d_model", 0)
    intermediate = getattr(config, "intermediate_size", None) or getattr(config, "d_ff", None) or 4 * hidden
    vocab = getattr(config, "vocab_size", 0) or 0
    element = _element_size(model)
    per_token = (8 * hidden + 3 * intermediate) * element
    return prefill_tokens * per_token + 2 * (prefill_tokens + rows) * vocab * 4


def device_budget(model: Any, device: Any, layout: Any, *, utilization: float, prefill_tokens: int,
                  rows: int) -> KVBudget | None:
    """The K/V budget of `device` (see the module docstring); None unless it is a CUDA device.
    Raises ValueError naming option.gpu_memory_utilization when not one token of K/V fits."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    torch.cuda.empty_cache()  # the warm-up's freed blocks go back: what stays is really in use
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    reserve = activation_reserve(model, prefill_tokens=prefill_tokens, rows=rows)
    per_token = kv_bytes_per_token(model, layout)
    available = int(utilization * total) - in_use - reserve
    tokens = max(0, available // per_token)
    budget = KVBudget(tokens, per_token, total, in_use, reserve, utilization)
    if tokens < 1:
        gib = 2**30
        raise ValueError(
            f"option.gpu_memory_utilization={utilization:g}: {utilization:g} x {total / gib:.1f} GiB leaves no room "
            f"for K/V after the {in_use / gib:.1f} GiB in use and a {reserve / gib:.2f} GiB activation reserve "
            f"(option.max_rolling_batch_prefill_tokens={prefill_tokens}): raise option.gpu_memory_utilization or "
            f"lower option.max_rolling_batch_prefill_tokens")
    return budget


def request_tokens(prompt_tokens: int, max_new_tokens: int, max_model_len: int | None) -> int:
    """The K/V tokens a request may reach: its prompt and every token it may generate, capped at the context."""
    reach = prompt_tokens + max_new_tokens
    return min(reach, max_model_len) if max_model_len else reach
