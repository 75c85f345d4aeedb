"""option.quantize through the real server: the default store started with OPTION_QUANTIZE=fp16 (and once
with q4 in bf16, the fast 4-bit path: it logs the stacked int4 swap and streams what it returns).
SmolLM2 (the model /invocations answers without a model name: the first text-generation model)
answers, logs what it swapped and the memory, streams what it returns whole, and gives greedy outputs
that do not depend on the company a request keeps. The variable reaches every model of the store; the
embedding model does not take option.quantize, so it leaves it out (and says so) instead of failing,
and the whole store serves. One server start for both (the swap's unit tests are test_quantize.py)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from server_process import serving

from lmi_serve.kernels.cpu import vnni_matmul

pytestmark = pytest.mark.integration

TEXT_MODEL, EMBEDDING_MODEL = "smollm2-135m-instruct", "all-minilm-l6-v2"
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3,", "Japanese words: 東京, 大阪,"]


@pytest.fixture(scope="module")
def fp16_server():
    """The default store (SmolLM2 + MiniLM) with OPTION_QUANTIZE=fp16, shared by this module's SmolLM2
    tests and its store tests: the same fp16 SmolLM2 a --model-dir start served, one start (~9 s) fewer."""
    with serving(env={"OPTION_QUANTIZE": "fp16"}) as server:
        yield server


@pytest.fixture(scope="module")
def quantized_store(fp16_server):
    return fp16_server


def generate(server, body, **kwargs):
    return requests.post(server.url("/invocations"), json=body, timeout=180, **kwargs)


def greedy(prompt: str, tokens: int = 16) -> dict:
    return {"inputs": prompt, "parameters": {"max_new_tokens": tokens, "details": True}}


def test_fp16_server_answers_and_logs_the_swap(fp16_server):
    body = generate(fp16_server, greedy("The capital of France is", 8)).json()
    assert body["generated_text"].strip() and len(body["details"]["tokens"]) >= 1
    log = fp16_server.output()
    assert "option.quantize=fp16: 211 Linear layers swapped" in log and "MiB ->" in log


def test_fp16_stream_equals_non_stream(fp16_server):
    for prompt in PROMPTS[2:]:
        whole = generate(fp16_server, greedy(prompt, 20)).json()["generated_text"]
        streamed = generate(fp16_server, {**greedy(prompt, 20), "stream": True}, stream=True)
        lines = [json.loads(line) for line in streamed.iter_lines() if line]
        assert "".join(line["token"]["text"] for line in lines) == whole == lines[-1]["generated_text"]


def test_fp16_greedy_is_the_same_alone_and_concurrently(fp16_server):
    def ids(body: dict) -> list[int]:
        return [t["id"] for t in generate(fp16_server, body).json()["details"]["tokens"]]

    bodies = [greedy(p, 10 + 4 * i) for i, p in enumerate(PROMPTS)]
    alone = [ids(b) for b in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(ids, bodies))
    assert together == alone


# --- the store: an OPTION_* variable for the text model reaches every model ---

def test_the_store_is_healthy(quantized_store):
    assert requests.get(quantized_store.url("/ping"), timeout=30).status_code == 200


def test_the_text_model_is_quantized_and_generates(quantized_store):
    reply = requests.post(quantized_store.url(f"/predictions/{TEXT_MODEL}"), timeout=120,
                          json={"inputs": "The capital of France is", "parameters": {"max_new_tokens": 4}})
    assert reply.status_code == 200, reply.text
    assert reply.json()["generated_text"].strip()
    assert "option.quantize=fp16:" in quantized_store.output()  # kernels/layers/quantize.py's report


def test_the_embedding_model_embeds(quantized_store):
    reply = requests.post(quantized_store.url("/v1/embeddings"), timeout=60,
                          json={"model": EMBEDDING_MODEL, "input": ["a cat", "a dog"]})
    assert reply.status_code == 200, reply.text
    assert [len(item["embedding"]) for item in reply.json()["data"]] == [384, 384]


def test_the_log_names_the_ignored_variable_and_the_model(quantized_store):
    lines = [line for line in quantized_store.output().splitlines() if "OPTION_QUANTIZE ignored" in line]
    assert len(lines) == 1 and f"Model {EMBEDDING_MODEL}:" in lines[0], lines


# --- the fast 4-bit path: option.quantize=q4 with option.dtype=bf16 ---

@pytest.fixture(scope="module")
def q4_bf16_server():
    """The default store with SmolLM2's own Q4_1 blocks on torch's int4 kernel, bf16 activations; its tied
    Q8_0 lm_head on its own blocks (the VNNI kernel) where this CPU has AVX-512 VNNI."""
    with serving(env={"OPTION_QUANTIZE": "q4", "OPTION_DTYPE": "bf16"}) as server:
        yield server


def test_q4_bf16_server_logs_the_stacked_int4_swap_and_streams_what_it_returns(q4_bf16_server):
    log = q4_bf16_server.output()
    swapped = 211 if vnni_matmul.kernel() is not None else 210  # the lm_head (tied, GGUF Q8_0) on the VNNI kernel only
    assert f"option.quantize=q4: {swapped} Linear layers swapped (150 of them stacked" in log, log[-3000:]
    assert "option.dtype=bf16" in log and "vectorized for bf16 activations only" not in log  # no slow-path warning
    for prompt in PROMPTS[0::2]:  # not the haiku: its first token is nearly a tie of a newline and EOS
        whole = generate(q4_bf16_server, greedy(prompt, 20)).json()
        streamed = generate(q4_bf16_server, {**greedy(prompt, 20), "stream": True}, stream=True)
        lines = [json.loads(line) for line in streamed.iter_lines() if line]
        assert whole["generated_text"].strip()
        assert "".join(line["token"]["text"] for line in lines) == whole["generated_text"]
        assert [line["token"]["id"] for line in lines] == [t["id"] for t in whole["details"]["tokens"]]
