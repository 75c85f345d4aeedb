"""Which KV implementation (kv/protocol.py) a model's rows get: by name (`option.kv_cache`), or the model's
default when the caller names none."""

from __future__ import annotations

import logging
from typing import Any

import psutil

from lmi_serve.engine.kv.dynamic import DynamicKV
from lmi_serve.engine.kv.encdec import EncoderDecoderKV
from lmi_serve.engine.kv.protocol import KVFactory
from lmi_serve.engine.kv.slots import SlotKV, slot_bytes

log = logging.getLogger(__name__)

# Decoder-only KV implementations by the name `option.kv_cache` and the benchmarks use.
KV_CACHES: dict[str, KVFactory] = {"dynamic": DynamicKV.prefill, "slots": SlotKV.prefill}


def is_encoder_decoder(model: Any) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def kv_factory_for(model: Any, name: str | None = None) -> KVFactory:
    """Encoder-decoder models (T5, BART) get kv/encdec.py's rows whatever `name` says; decoder-only
    ones the implementation named (by default the left-padded DynamicCache of kv/dynamic.py)."""
    if is_encoder_decoder(model):
        return EncoderDecoderKV.prefill
    if name is None:
        return DynamicKV.prefill
    try:
        return KV_CACHES[name]
    except KeyError:
        raise ValueError(f"unknown kv_cache {name!r}; known: {', '.join(sorted(KV_CACHES))}") from None


def choose_kv(model: Any, name: str, *, rows: int, columns: int) -> KVFactory:
    """`kv_factory_for`, logged once. Slot buffers grow as used, up to `rows` rows of `columns`
    tokens: when not even one such row fits in the memory available now, start-up fails, saying what
    to lower; when the whole bound does not fit, a warning says so (most servers never fill every row
    to the context limit, and refusing the default configuration on a small machine would help no one)."""
    factory = kv_factory_for(model, name)
    if is_encoder_decoder(model):
        log.info("KV cache: encoder-decoder rows (kv/encdec.py); option.kv_cache=%s applies to decoder-only models",
                 name)
    elif factory == SlotKV.prefill:
        need, available = slot_bytes(model, rows, columns), psutil.virtual_memory().available
        advice = "lower option.max_model_len or option.max_rolling_batch_size, or set option.kv_cache=dynamic"
        if slot_bytes(model, 1, columns) > available:
            raise ValueError(f"option.kv_cache=slots: one row of {columns} tokens needs "
                             f"{slot_bytes(model, 1, columns) / 2**30:.1f} GiB and {available / 2**30:.1f} GiB is "
                             f"available: {advice}")
        if need > available:
            log.warning("KV cache: slots may grow to %.1f GiB (%d rows x %d tokens), more than the %.1f GiB "
                        "available now: %s", need / 2**30, rows, columns, available / 2**30, advice)
        log.info("KV cache: slots, grown as used up to %.2f GiB (%d rows x %d tokens)", need / 2**30, rows, columns)
    else:
        log.info("KV cache: %s", name)
    return factory
