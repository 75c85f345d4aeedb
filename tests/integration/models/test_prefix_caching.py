"""Prefix caching end to end: the store's `prefixed` model (option.enable_prefix_caching=true)
answers every dialect's text routes, streamed and not, exactly what the default server (no prefix
cache, same weights) answers, while most of each prompt comes from the cache."""

from __future__ import annotations

import json

import pytest
import requests
import sseclient
from openai import OpenAI

pytestmark = pytest.mark.integration

MODEL = "prefixed"
SYSTEM = ("You are the support assistant of a small bakery in Lyon. You answer questions about opening hours, "
          "bread, cakes, allergens and orders. Keep answers short and friendly, and never invent prices. "
          "The bakery opens at seven and closes at seven, except on Sundays, when it closes at one.")
QUESTIONS = ["Do you sell croissants?", "When do you open on Sunday?", "Is there gluten in the rye bread?"]
NEW_TOKENS = 8


def lmi(server, path: str, prompt: str, stream: bool) -> str:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS}, "stream": stream}
    response = requests.post(server.url(path), json=body, timeout=180, stream=stream)
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()["generated_text"]
    lines = [json.loads(line) for line in response.iter_lines() if line]
    return "".join(line["token"]["text"] for line in lines if "token" in line)


def tgi(server, prompt: str, stream: bool) -> str:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS}}
    path = "/generate_stream" if stream else "/generate"
    response = requests.post(server.url(path), params={"model_name": MODEL}, json=body, timeout=180, stream=stream)
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()["generated_text"]
    events = [json.loads(e.data) for e in sseclient.SSEClient(response).events()]
    return "".join(e["token"]["text"] for e in events if not e["token"]["special"])


def triton(server, prompt: str, stream: bool) -> str:
    body = json.dumps({"text_input": prompt, "max_tokens": NEW_TOKENS})
    path = f"/v2/models/{MODEL}/generate_stream" if stream else f"/v2/models/{MODEL}/generate"
    response = requests.post(server.url(path), data=body, timeout=180, stream=stream)
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()["text_output"]
    return "".join(json.loads(e.data)["text_output"] for e in sseclient.SSEClient(response).events())


def openai_chat(client: OpenAI, model: str, question: str, stream: bool) -> str:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    if not stream:
        return client.chat.completions.create(model=model, messages=messages, max_tokens=NEW_TOKENS,
                                              temperature=0).choices[0].message.content
    chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=NEW_TOKENS, temperature=0,
                                            stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def prefix_stats(server) -> dict:
    described = requests.get(server.url(f"/models/{MODEL}"), timeout=10).json()[0]["models"][0]
    return described["engine"]["prefixCache"]


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return [f"{SYSTEM}\n\nQuestion: {q}\nAnswer:" for q in QUESTIONS]


@pytest.fixture(scope="module")
def expected(default_server, prompts) -> list[str]:
    texts = [lmi(default_server, "/invocations", p, stream=False) for p in prompts]
    assert len(set(texts)) == len(texts) and all(t.strip() for t in texts)  # premise: answers differ
    return texts


def test_every_dialect_answers_what_the_uncached_server_does(store_server, prompts, expected):
    before = prefix_stats(store_server)
    for stream in (False, True):
        for prompt, text in zip(prompts, expected):
            assert lmi(store_server, f"/predictions/{MODEL}", prompt, stream) == text
            assert tgi(store_server, prompt, stream) == text
            assert triton(store_server, prompt, stream) == text
    after = prefix_stats(store_server)
    runs = after["lookups"] - before["lookups"]
    assert runs == 2 * 3 * len(prompts)
    assert after["hits"] - before["hits"] >= runs - 1  # only the very first prompt can miss
    assert after["hitTokens"] - before["hitTokens"] >= 0.6 * (after["promptTokens"] - before["promptTokens"])
    assert 0 < after["bytes"] and after["blocks"] > 0


def test_chats_sharing_a_system_prompt_answer_what_the_uncached_server_does(store_server, default_server,
                                                                           openai_client):
    cached, uncached = openai_client(store_server, strict=False), openai_client(default_server, strict=False)
    for question in QUESTIONS:
        expected = openai_chat(uncached, "smollm2-135m-instruct", question, stream=False)
        assert openai_chat(cached, MODEL, question, stream=False) == expected
        assert openai_chat(cached, MODEL, question, stream=True) == expected
    assert prefix_stats(store_server)["hits"] >= 2 * len(QUESTIONS) - 1
