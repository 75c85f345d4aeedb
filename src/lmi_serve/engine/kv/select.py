"""Which KV layout (kv/protocol.py) a model's rows get: by name (`option.kv_cache`), or the default
(`config.models.DEFAULT_KV_CACHE`, the server's too) when the caller names none. Encoder-decoder
models get their own rows whatever the name says: the choice of family is made here and nowhere else."""

from __future__ import annotations

import logging
from typing import Any

import psutil
import torch

from lmi_serve.config.models import DEFAULT_KV_CACHE
from lmi_serve.engine.kv.dynamic import DYNAMIC
from lmi_serve.engine.kv.encdec import ENCODER_DECODER
from lmi_serve.engine.kv.protocol import KVLayout
from lmi_serve.engine.kv.slots import SLOTS

log = logging.getLogger(__name__)

# Decoder-only KV layouts by the name `option.kv_cache` and the benchmarks use.
KV_LAYOUTS: dict[str, KVLayout] = {layout.name: layout for layout in (DYNAMIC, SLOTS)}


def is_encoder_decoder(model: Any) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def layout_for(model: Any, name: str = DEFAULT_KV_CACHE) -> KVLayout:
    """Encoder-decoder models (T5, BART) get kv/encdec.py's rows whatever `name` says; decoder-only
    ones the layout named (by default the server's default)."""
    if is_encoder_decoder(model):
        return ENCODER_DECODER
    try:
        return KV_LAYOUTS[name]
    except KeyError:
        raise ValueError(f"unknown kv_cache {name!r}; known: {', '.join(sorted(KV_LAYOUTS))}") from None


def choose_kv(model: Any, name: str, *, rows: int, columns: int, device: Any = None) -> KVLayout:
    """`layout_for`, logged once. A layout with a memory bound (slots: buffers grow as used, up to
    `rows` rows of `columns` tokens) is checked against the memory available now: when not even one
    such row fits, start-up fails, saying what to lower; when the whole bound does not fit, a warning
    says so (most servers never fill every row to the context limit, and refusing the default
    configuration on a small machine would help no one). On a CUDA `device` the host's memory is not
    where K/V lives: nothing is checked here, build.py sizes the K/V budget from the device's memory
    (kv/budget.py, option.gpu_memory_utilization) once the model is warmed up."""
    layout = layout_for(model, name)
    need = layout.memory_bytes(model, rows, columns)
    if layout is ENCODER_DECODER:
        log.info("KV cache: encoder-decoder rows (kv/encdec.py); option.kv_cache=%s applies to decoder-only models",
                 name)
    elif need is not None and device is not None and torch.device(device).type == "cuda":
        log.info("KV cache: %s, bounded by the GPU memory budget (option.gpu_memory_utilization)", name)
    elif need is not None:
        one, available = layout.memory_bytes(model, 1, columns), psutil.virtual_memory().available
        advice = f"lower option.max_model_len or option.max_rolling_batch_size, or set option.kv_cache={DYNAMIC.name}"
        if one > available:
            raise ValueError(f"option.kv_cache={name}: one row of {columns} tokens needs {one / 2**30:.1f} GiB and "
                             f"{available / 2**30:.1f} GiB is available: {advice}")
        if need > available:
            log.warning("KV cache: %s may grow to %.1f GiB (%d rows x %d tokens), more than the %.1f GiB "
                        "available now: %s", name, need / 2**30, rows, columns, available / 2**30, advice)
        log.info("KV cache: %s, grown as used up to %.2f GiB (%d rows x %d tokens)", name, need / 2**30, rows, columns)
    else:
        log.info("KV cache: %s", name)
    return layout
