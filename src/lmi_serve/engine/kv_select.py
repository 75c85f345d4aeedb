"""Which KV implementation (kv.py) a model's rows get when the caller names none."""

from __future__ import annotations

from typing import Any

from .kv import KVFactory
from .kv_dynamic import DynamicKV
from .kv_encdec import EncoderDecoderKV


def is_encoder_decoder(model: Any) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def kv_factory_for(model: Any) -> KVFactory:
    """Encoder-decoder models (T5, BART) get kv_encdec.py's rows; decoder-only ones the left-padded
    DynamicCache of kv_dynamic.py."""
    return EncoderDecoderKV.prefill if is_encoder_decoder(model) else DynamicKV.prefill
