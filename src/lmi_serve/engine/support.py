"""Which models the engine serves exactly, checked once at start-up.

The engine batches rows of different lengths in one left-padded transformers `DynamicCache`
(kv/dynamic.py): a row's logits must not depend on the padding or on its neighbours. That holds for
decoder-only models whose every layer is full, sliding-window or chunked attention over a KV cache,
fed per-row position ids (or ALiBi, which depends only on distances), and for the encoder-decoder
families kv/encdec.py knows how to give per-row decoder positions (T5's relative bias, BART's
position embeddings). `tests/unit/engine/
test_architectures.py` checks the families it names token for token against `model.generate()`.

Anything else would answer wrong text, or fail every request, so the model fails to load instead:
`check_supported` raises `UnsupportedModel` naming the model type and what cannot be served.
"""

from __future__ import annotations

import inspect
from typing import Any

from lmi_serve.engine.kv.encdec import DECODER_POSITIONS
from lmi_serve.engine.layer_kinds import layer_types

# Layer kinds (transformers' `config.layer_types` names) a left-padded DynamicCache serves exactly:
# every layer keeps its whole KV; transformers' masks apply the window or the chunks per row.
SERVED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})

# Model types whose forward takes no position ids but whose positions are ALiBi biases (they depend
# only on the distance between tokens, so left padding does not shift them); the matrix checks them.
ALIBI_MODEL_TYPES = frozenset({"bloom", "mpt"})


class UnsupportedModel(ValueError):
    """The engine cannot serve this model exactly; raised at load, so the model never serves."""


def _forward_parameters(model: Any) -> set[str] | None:
    forward = getattr(type(model), "forward", None)
    if forward is None:
        return None
    try:
        return set(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        return None


def check_supported(model: Any) -> None:
    """Raise UnsupportedModel if the engine cannot serve `model` exactly; return None if it can."""
    config = getattr(model, "config", None)
    if config is None:
        return
    model_type = getattr(config, "model_type", None) or type(model).__name__
    what = f"Model type {model_type!r} ({type(model).__name__})"
    ending = ("; the server serves decoder-only causal LMs whose layers are full, sliding-window or chunked attention, "
              f"and the encoder-decoder types {', '.join(repr(t) for t in sorted(DECODER_POSITIONS))}")

    if getattr(config, "is_encoder_decoder", False):
        if model_type not in DECODER_POSITIONS:
            raise UnsupportedModel(f"{what} is an encoder-decoder model of a family the engine has not been "
                                   f"checked to serve exactly{ending}")
        return  # kv/encdec.py: per-row decoder positions for each of these (checked by the matrix)

    supports_dynamic_cache = getattr(type(model), "_supports_default_dynamic_cache", None)
    if callable(supports_dynamic_cache) and not supports_dynamic_cache():
        raise UnsupportedModel(f"{what} needs its own cache class, not transformers' DynamicCache that the "
                               f"engine batches{ending}")

    parameters = _forward_parameters(model)
    if parameters is not None and "past_key_values" not in parameters:
        raise UnsupportedModel(f"{what} takes no past_key_values (it keeps no KV cache, or a recurrent state "
                               f"instead), so the engine cannot carry its rows from one step to the next{ending}")

    try:
        text_config = config.get_text_config(decoder=True)
    except (AttributeError, TypeError, ValueError):
        text_config = config
    unsupported = sorted(set(layer_types(text_config)) - SERVED_LAYER_TYPES)
    if unsupported:
        raise UnsupportedModel(f"{what} has {', '.join(repr(t) for t in unsupported)} layers, which the engine's "
                               f"left-padded KV cache cannot serve exactly{ending}")

    text_type = getattr(text_config, "model_type", None) or model_type
    if parameters is not None and "position_ids" not in parameters and not (
            {model_type, text_type} & ALIBI_MODEL_TYPES):
        raise UnsupportedModel(f"{what} takes no position_ids: it would count a row's positions from the start of "
                               f"the shared, left-padded batch, so answers would depend on the other "
                               f"requests{ending}")


def takes_images(model: Any) -> bool:
    """Whether `model`'s forward takes `pixel_values` (a vision-language model): its requests may carry
    images (types.ImageInputs); a text model's may not."""
    return "pixel_values" in (_forward_parameters(model) or ())
