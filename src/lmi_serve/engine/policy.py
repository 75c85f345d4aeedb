"""Seeds and context limits: the rules every dialect applies to a request's sequences.

Seeds: sequence i of a request samples with base + i, modulo 2**63, so every seed reported back
(TGI's `details.seed`, LMI's `seed`, OpenAI's `system_fingerprint`-free replies) can be sent again
as a `seed` and reproduce that sequence. The base is the client's seed, or one random seed drawn
here for a sampled request without one; a greedy request has no seed.

Context: the prompt must leave room for at least one new token within `max_model_len`. What a
request asking for more than the room gets is the dialect's choice: LMI caps `max_new_tokens`
(DJL does), OpenAI and TGI refuse (as vLLM and TGI do).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Literal

from lmi_serve.errors import ContextOverflow, InvalidRequest

MAX_SEED = 2**63 - 1  # seeds are int64 on every wire; torch's generators take them as they are


DEFAULT_CONTEXT = 2048  # a model whose config names no window (max_position_embeddings)


def text_config(model: Any) -> Any:
    """The config of `model`'s text decoder: a vision-language model keeps its positions and vocabulary
    there, not in its top-level config; a text model's is its own."""
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def context_window(model: Any) -> int:
    """The most tokens (prompt and generated) a row of `model` can hold: its (text) config's positions."""
    return getattr(text_config(model), "max_position_embeddings", None) \
        or getattr(model.config, "max_position_embeddings", None) or DEFAULT_CONTEXT


def vocab_size(model: Any, tokenizer: Any) -> int:
    """The logits' width: the (text) config's vocabulary, else the tokenizer's."""
    return getattr(text_config(model), "vocab_size", None) or len(tokenizer)


def max_model_len(model: Any, requested: int | None) -> int:
    """`requested` (option.max_model_len), capped at the model's context window; the window if None."""
    window = context_window(model)
    return min(requested or window, window)


def sequence_seeds(seed: int | None, count: int, *, sampled: bool) -> list[int | None]:
    """The seeds of a request's `count` sequences (see the module docstring); any integer `seed`
    is taken modulo 2**63, so a negative int64 maps into the range too."""
    if seed is None and not sampled:
        return [None] * count
    base = random.randrange(MAX_SEED + 1) if seed is None else seed % (MAX_SEED + 1)
    return [(base + i) % (MAX_SEED + 1) for i in range(count)]


def fit_to_context(prompt: Sequence[int], max_new_tokens: int | None, max_model_len: int, *,
                   over: Literal["cap", "refuse"], max_input_len: int | None = None,
                   where: str = "input", param: str | None = None) -> tuple[tuple[int, ...], int]:
    """(prompt ids, max new tokens) that fit the context. `max_new_tokens` None means all the room
    left. A prompt that encodes to nothing, is over `max_input_len`, or leaves no room is an
    InvalidRequest (ContextOverflow for the last); asking for more than the room is capped
    (`over="cap"`) or a ContextOverflow (`over="refuse"`)."""
    prompt = tuple(prompt)
    if not prompt:
        raise InvalidRequest(f"The {where} encodes to no tokens", param=param)
    if max_input_len is not None and len(prompt) > max_input_len:
        raise ContextOverflow(f"Input has {len(prompt)} tokens, over the limit of {max_input_len}", param=param)
    room = max_model_len - len(prompt)
    wanted = room if max_new_tokens is None else max_new_tokens
    if room < 1 or (over == "refuse" and wanted > room):
        raise ContextOverflow(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{len(prompt) + max(wanted, 1)} tokens ({len(prompt)} in the {where}, {max(wanted, 1)} in the "
            f"completion). Please reduce the length of the {where} or completion.", param=param)
    return prompt, min(wanted, room)
