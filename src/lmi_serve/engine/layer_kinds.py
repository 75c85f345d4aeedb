"""A decoder's layer kinds as transformers names them: what support.py checks at load and what
kv/mixed.py asks before packing a model's forward (a module of its own: the KV layouts may import it,
and support.py imports the layouts)."""

from __future__ import annotations

from typing import Any


def layer_types(config: Any) -> list[str]:
    """Each decoder layer's kind, named as transformers names it (legacy names translated); where
    the config lists none, inferred as transformers' cache does (sliding window, attention chunks)."""
    types = getattr(config, "layer_types", None)
    if types is None:
        if getattr(config, "sliding_window", None) is not None:
            kind = "sliding_attention"
        elif getattr(config, "attention_chunk_size", None) is not None:
            kind = "chunked_attention"
        else:
            kind = "full_attention"
        return [kind]
    types = list(types)
    try:
        from transformers.configuration_utils import remap_legacy_layer_types
    except ImportError:  # an older transformers: its names are the legacy ones we check anyway
        return types
    return remap_legacy_layer_types(types)
