"""An OPTION_* variable meant for the text model reaches every model of the default store; the
embedding model does not take option.quantize, so it leaves it out (and says so) instead of
failing, and the whole store serves."""

from __future__ import annotations

import pytest
import requests

from server_process import serving

pytestmark = pytest.mark.integration

TEXT_MODEL, EMBEDDING_MODEL = "smollm2-135m-instruct", "all-minilm-l6-v2"


@pytest.fixture(scope="module")
def quantized_store():
    with serving(env={"OPTION_QUANTIZE": "fp16"}) as server:
        yield server


def test_the_store_is_healthy(quantized_store):
    assert requests.get(quantized_store.url("/ping"), timeout=30).status_code == 200


def test_the_text_model_is_quantized_and_generates(quantized_store):
    reply = requests.post(quantized_store.url(f"/predictions/{TEXT_MODEL}"), timeout=120,
                          json={"inputs": "The capital of France is", "parameters": {"max_new_tokens": 4}})
    assert reply.status_code == 200, reply.text
    assert reply.json()["generated_text"].strip()
    assert "option.quantize=fp16:" in quantized_store.output()  # model/quantize.py's report


def test_the_embedding_model_embeds(quantized_store):
    reply = requests.post(quantized_store.url("/v1/embeddings"), timeout=60,
                          json={"model": EMBEDDING_MODEL, "input": ["a cat", "a dog"]})
    assert reply.status_code == 200, reply.text
    assert [len(item["embedding"]) for item in reply.json()["data"]] == [384, 384]


def test_the_log_names_the_ignored_variable_and_the_model(quantized_store):
    lines = [line for line in quantized_store.output().splitlines() if "OPTION_QUANTIZE ignored" in line]
    assert len(lines) == 1 and f"Model {EMBEDDING_MODEL}:" in lines[0], lines
