"""A model's memory by part, and its worker's resident total: the `memory` section of GET /models/<m>.

    weights          the weights in the forms the kernel plan left them (kernels/footprint.py)
    row copies       the row kernel's second copy of fp32 Linear weights (option.row_kernel)
    K/V              what the running rows' K/V storage held at the engine's last step
    prefix cache     the cached prefix blocks held now, and the bound they stay within (option.prefix_cache_mb)
    resident         the worker process's RSS: every model's parts plus the runtime (torch, numba's compiled
                     kernels, tokenizers, Python) and the allocator's free pages not yet given back

A part the server cannot see (a custom handler's model: no kernel plan; no rolling batch: no K/V) is None.
Read from sizes the model and engine already keep: cheap enough for every GET."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psutil


@dataclass(frozen=True)
class ModelMemory:
    resident: int
    weights: int | None = None
    row_copies: int | None = None
    kv_cache: int | None = None
    prefix_cache: int | None = None
    prefix_cache_budget: int | None = None


def model_memory(service: Any) -> ModelMemory:
    """`service`'s (serving/service.ModelService) parts and its worker's resident bytes now."""
    footprint = getattr(getattr(service, "kernels", None), "memory", None)
    stats = service.engine.stats() if getattr(service, "engine", None) is not None else None
    prefixes = stats.prefix_cache if stats is not None else None
    return ModelMemory(
        resident=psutil.Process().memory_info().rss,
        weights=footprint.weights if footprint is not None else None,
        row_copies=footprint.row_copies if footprint is not None else None,
        kv_cache=stats.kv_cache_bytes if stats is not None else None,
        prefix_cache=prefixes.bytes if prefixes is not None else None,
        prefix_cache_budget=service.config.prefix_cache_mb * 2**20 if prefixes is not None else None)
