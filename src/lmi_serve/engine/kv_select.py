"""Which KV implementation (kv.py) a model's rows get: by name (`option.kv_cache`), or the model's
default when the caller names none."""

from __future__ import annotations

from typing import Any

from .kv import KVFactory
from .kv_dynamic import DynamicKV
from .kv_encdec import EncoderDecoderKV
from .kv_slots import SlotKV

# Decoder-only KV implementations by the name `option.kv_cache` and the benchmarks use.
KV_CACHES: dict[str, KVFactory] = {"dynamic": DynamicKV.prefill, "slots": SlotKV.prefill}


def is_encoder_decoder(model: Any) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def kv_factory_for(model: Any, name: str | None = None) -> KVFactory:
    """Encoder-decoder models (T5, BART) get kv_encdec.py's rows whatever `name` says; decoder-only
    ones the implementation named (by default the left-padded DynamicCache of kv_dynamic.py)."""
    if is_encoder_decoder(model):
        return EncoderDecoderKV.prefill
    if name is None:
        return DynamicKV.prefill
    try:
        return KV_CACHES[name]
    except KeyError:
        raise ValueError(f"unknown kv_cache {name!r}; known: {', '.join(sorted(KV_CACHES))}") from None
