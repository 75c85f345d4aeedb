"""option.draft_model_id=ngram through the real server (the default store, OPTION_DRAFT_MODEL_ID=ngram):
SmolLM2 says at start-up that it speculates, a chat answer that repeats its prompt is served with drafts
accepted (counted in GET /models/<m> and /metrics), streamed as it is returned whole, and a request
alone (which speculates) gets what it gets in company (a batch of several rows does not speculate). The
embedding model of the store leaves the variable out. Equality with decoding one token a step is
test_speculation.py's (unit) and benchmarks/bench_speculation.py's (the real model, every prompt)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from openai import OpenAI

from server_process import serving

pytestmark = pytest.mark.integration

TEXT_MODEL = "smollm2-135m-instruct"
PARAGRAPH = ("A river begins as rain. Water that falls on a hillside either soaks into the soil or runs across the "
             "surface, and the part that runs collects in small channels that join one another as they descend.")
QUOTE = [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}"}]


@pytest.fixture(scope="module")
def server():
    with serving(env={"OPTION_DRAFT_MODEL_ID": "ngram"}) as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=180)


def speculation(server) -> dict:
    reply = requests.get(server.url(f"/models/{TEXT_MODEL}"), timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()[0]["models"][0]["engine"]["speculation"]


def test_the_text_model_speculates_and_the_embedding_model_leaves_the_variable_out(server):
    log = server.output()
    assert "n-gram speculation on: up to 4 draft tokens a step" in log, log[-3000:]
    assert "OPTION_DRAFT_MODEL_ID ignored" in log


def test_a_quote_is_served_with_drafts_accepted_and_streamed_as_returned(server, client):
    before = speculation(server)
    whole = client.chat.completions.create(model=TEXT_MODEL, messages=QUOTE, max_tokens=48, temperature=0)
    after = speculation(server)
    assert after["acceptedTokens"] - before["acceptedTokens"] >= 10, (before, after)
    assert after["draftTokens"] >= after["acceptedTokens"] > 0 and after["steps"] > before["steps"]
    text = whole.choices[0].message.content
    assert "river begins as rain" in text  # SmolLM2 quotes it
    chunks = client.chat.completions.create(model=TEXT_MODEL, messages=QUOTE, max_tokens=48, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    metrics = requests.get(server.url("/metrics"), timeout=30).text
    accepted = [line for line in metrics.splitlines()
                if line.startswith("lmi_serve:spec_decode_num_accepted_tokens_total") and TEXT_MODEL in line]
    assert accepted and float(accepted[0].split()[-1]) >= after["acceptedTokens"]


def test_greedy_alone_with_speculation_equals_greedy_in_company_without(server):
    def ids(prompt: str) -> list[int]:
        body = {"inputs": prompt, "parameters": {"max_new_tokens": 40, "details": True}}
        reply = requests.post(server.url("/invocations"), json=body, timeout=180)
        assert reply.status_code == 200, reply.text
        return [t["id"] for t in reply.json()["details"]["tokens"]]

    prompts = [f"{PARAGRAPH}\n\nRepeat that: {PARAGRAPH[:40]}", "1, 2, 3, 4, 5, 1, 2, 3,", "The capital of France is"]
    alone = [ids(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(ids, prompts))
    assert together == alone
