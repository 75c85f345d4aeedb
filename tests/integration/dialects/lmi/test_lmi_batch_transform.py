"""SageMaker Batch Transform and async inference against one real server (a tiny random Llama, fast):
GET /execution-parameters, a MultiRecord JSON Lines body answered record by record (a bad record in
its place, the others as if sent alone, in the engine together), and what async inference needs of
/invocations: whole answers with Content-Length on every dialect, a long generation, a body of
several MB under SAGEMAKER_MAX_PAYLOAD_IN_MB (and a 413 over it)."""

from __future__ import annotations

import json

import pytest
import requests

from server_process import serving
from tiny_hub_model import tiny_llama_files

pytestmark = pytest.mark.integration

PAYLOAD_MB = 8
ROWS = 6
# A long answer, whole (an async inference's): 256 steps, ~10 s on a busy 2-core machine (512 took 20, 1000 over 40)
LONG = 256
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    for name, content in tiny_llama_files().items():
        (folder / name).write_bytes(content)
    env = {"HF_MODEL_ID": str(folder), "SAGEMAKER_MAX_PAYLOAD_IN_MB": str(PAYLOAD_MB),
           "OPTION_MAX_ROLLING_BATCH_SIZE": str(ROWS), "OPTION_MAX_MODEL_LEN": "1536"}
    with serving(env=env) as server:
        server.model = requests.get(server.url("/models"), timeout=10).json()["models"][0]["modelName"]
        yield server


def post(server, path, body=None, **kwargs):
    return requests.post(server.url(path), json=body, timeout=300, **kwargs)


def greedy(prompt, max_new_tokens=40):
    return {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos_token": True}}


def whole(response) -> requests.Response:
    """`response`, checked to be a whole body that says its length (what async inference stores)."""
    assert response.status_code == 200, response.text
    assert "chunked" not in response.headers.get("Transfer-Encoding", "")
    assert int(response.headers["Content-Length"]) == len(response.content)
    return response


def test_execution_parameters(server):
    answer = requests.get(server.url("/execution-parameters"), timeout=10)
    assert answer.status_code == 200
    assert answer.json() == {"MaxConcurrentTransforms": ROWS, "BatchStrategy": "MULTI_RECORD",
                             "MaxPayloadInMB": PAYLOAD_MB}


def largest_batch(server) -> int:
    described = requests.get(server.url(f"/models/{server.model}"), timeout=10).json()
    return described[0]["models"][0]["engine"]["largestBatch"]


def test_multi_record_body_answers_each_line_in_place(server):
    records = [greedy(p, 48) for p in PROMPTS]
    bad = {"inputs": "x", "parameters": {"max_new_tokens": -3}}
    lines = [json.dumps(records[0]), json.dumps(records[1]), json.dumps(bad), "{not json",
             json.dumps({**records[2], "stream": True}), json.dumps(records[2]), json.dumps(records[3])]
    body = ("\n".join(lines) + "\n").encode()
    answer = whole(requests.post(server.url("/invocations"), data=body,
                                 headers={"Content-Type": "application/jsonlines"}, timeout=300))
    assert answer.headers["Content-Type"].startswith("application/jsonlines")
    got = [json.loads(line) for line in answer.text.splitlines()]
    assert len(got) == len(lines)
    # a bad line gets what LMI answers that line alone, in its place
    for index, line in ((2, bad), (3, "{not json")):
        alone = requests.post(server.url("/invocations"), data=line if isinstance(line, str) else json.dumps(line),
                              headers={"Content-Type": "application/json"}, timeout=60)
        assert alone.status_code == 424 and got[index] == alone.json()
    assert got[4]["code"] == 424 and "Streaming is not available" in got[4]["error"]
    # the others: greedy outputs equal to each record sent alone
    singles = [post(server, "/invocations", r).json() for r in records]
    assert [got[0], got[1], got[5], got[6]] == singles
    assert largest_batch(server) > 1  # the records were in the engine together


def test_json_lines_sent_as_application_json(server):
    # the job's ContentType may say application/json: a first line that is a whole JSON value says lines
    records = [greedy(p, 4) for p in PROMPTS[:2]]
    body = "\n".join(json.dumps(r) for r in records)
    answer = whole(requests.post(server.url(f"/predictions/{server.model}"), data=body,
                                 headers={"Content-Type": "application/json"}, timeout=60))
    assert [json.loads(line) for line in answer.text.splitlines()] == [post(server, "/invocations", r).json()
                                                                       for r in records]


def test_single_record_is_unchanged(server):
    body = json.dumps(greedy(PROMPTS[0], 8)) + "\n"
    answer = whole(requests.post(server.url("/invocations"), data=body,
                                 headers={"Content-Type": "application/jsonlines"}, timeout=60))
    assert answer.headers["Content-Type"].startswith("application/json") and "generated_text" in answer.json()


def test_whole_answers_carry_content_length(server):
    whole(post(server, "/invocations", greedy(PROMPTS[1], 8)))
    whole(post(server, f"/predictions/{server.model}", greedy(PROMPTS[1], 8)))
    whole(post(server, "/v1/completions", {"model": server.model, "prompt": PROMPTS[0], "max_tokens": 8}))
    whole(post(server, "/v1/chat/completions", {"model": server.model, "max_tokens": 8,
                                                "messages": [{"role": "user", "content": "Hi"}]}))
    whole(post(server, "/generate", {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 8}}))
    whole(post(server, f"/v2/models/{server.model}/generate", {"text_input": PROMPTS[0], "max_tokens": 8}))


def test_long_generation(server):
    answer = whole(post(server, "/invocations", {"inputs": PROMPTS[3], "parameters": {
        "max_new_tokens": LONG, "ignore_eos_token": True, "details": True}}))
    assert answer.json()["details"]["generated_tokens"] == LONG


def test_a_body_of_several_mb_under_the_limit_is_served(server):
    prompt = "lorem ipsum dolor sit amet " * (5 * 2**20 // 27)  # about 5 MiB of prompt
    body = json.dumps({"inputs": prompt, "parameters": {"truncate": 64, "max_new_tokens": 4}}).encode()
    assert 5 * 2**20 - 100 < len(body) < PAYLOAD_MB * 2**20
    answer = whole(requests.post(server.url("/invocations"), data=body,
                                 headers={"Content-Type": "application/json"}, timeout=300))
    assert answer.json()["generated_text"]
    over = requests.post(server.url("/invocations"), data=b" " * (PAYLOAD_MB * 2**20 + 1),
                         headers={"Content-Type": "application/json"}, timeout=60)
    assert over.status_code == 413 and over.json()["code"] == 413
