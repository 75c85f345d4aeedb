"""The TGI dialect with the official `text-generation` client (strict pydantic models)."""

from __future__ import annotations

import asyncio

import pytest
import requests
from text_generation import AsyncClient, Client
from text_generation.errors import ValidationError
from text_generation.types import FinishReason

pytestmark = pytest.mark.integration

PROMPTS = ["The capital of France is", "Water boils at", "1, 2, 3,", "Once upon a time", "List three colors:",
           "The opposite of hot is", "My favourite food is", "In 1492,"]


@pytest.fixture(scope="module")
def client(default_server):
    return Client(default_server.base, timeout=180)


def test_generate_details(client):
    response = client.generate("Hello, my name is", max_new_tokens=5)
    details = response.details
    assert isinstance(response.generated_text, str)
    assert details.generated_tokens == len(details.tokens) == 5
    assert details.finish_reason == FinishReason.Length
    assert details.seed is None and details.prefill == []
    assert all(isinstance(t.special, bool) for t in details.tokens)


def test_decoder_input_details_and_top_tokens(client):
    response = client.generate("The capital of France is", max_new_tokens=3, decoder_input_details=True,
                               top_n_tokens=3)
    prefill = response.details.prefill
    assert len(prefill) > 1 and prefill[0].logprob is None
    assert all(p.logprob is not None for p in prefill[1:])
    assert len(response.details.top_tokens) == 3 and all(len(t) == 3 for t in response.details.top_tokens)


def test_stop_sequences_and_eos(client):
    stopped = client.generate("The capital of France is", max_new_tokens=20, stop_sequences=["."])
    assert stopped.details.finish_reason == FinishReason.StopSequence
    assert stopped.generated_text == " Paris"
    answered = client.generate("<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n", max_new_tokens=60)
    assert answered.details.finish_reason == FinishReason.EndOfSequenceToken
    assert answered.details.tokens[-1].special is True


def test_seeded_sampling_reports_its_seed(client):
    kwargs = dict(do_sample=True, seed=42, temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=12)
    first = client.generate("Once upon a time", **kwargs)
    assert client.generate("Once upon a time", **kwargs).generated_text == first.generated_text
    assert first.details.seed == 42


def test_return_full_text_best_of_and_truncate(client, default_server):
    full = client.generate("Water boils at", max_new_tokens=3, return_full_text=True)
    assert full.generated_text.startswith("Water boils at")
    best = client.generate("Once upon a time", best_of=2, do_sample=True, max_new_tokens=6)
    assert len(best.details.best_of_sequences) == 1
    raw = requests.post(default_server.url("/generate"), timeout=60, json={
        "inputs": "one two three four five six seven eight nine ten eleven twelve",
        "parameters": {"max_new_tokens": 2, "truncate": 4}})
    assert raw.status_code == 200 and int(raw.headers["x-prompt-tokens"]) == 4


def test_best_of_sequences_report_the_seed_each_was_sampled_with(client):
    kwargs = dict(do_sample=True, temperature=1.5, max_new_tokens=8)
    best = client.generate("Once upon a time", best_of=3, **kwargs)
    sequences = [best, *best.details.best_of_sequences]
    seeds = [best.details.seed] + [s.seed for s in best.details.best_of_sequences]
    assert len(sequences) == 3 and None not in seeds and len(set(seeds)) == 3
    for sequence, seed in zip(sequences, seeds):
        replay = client.generate("Once upon a time", seed=seed, **kwargs)
        assert replay.generated_text == sequence.generated_text


def test_generate_stream_frames(client):
    frames = list(client.generate_stream("The capital of France is", max_new_tokens=8))
    assert len(frames) == 8
    assert all(f.generated_text is None and f.details is None for f in frames[:-1])
    assert frames[-1].details.finish_reason == FinishReason.Length
    assert "".join(f.token.text for f in frames) == frames[-1].generated_text
    assert frames[-1].generated_text == client.generate("The capital of France is", max_new_tokens=8).generated_text


def test_validation_errors(client, default_server):
    with pytest.raises(ValidationError, match="max_new_tokens"):
        client.generate("x", max_new_tokens=100000)
    with pytest.raises(ValidationError):
        list(client.generate_stream("x", max_new_tokens=100000))
    raw = requests.post(default_server.url("/generate"), timeout=30,
                        json={"inputs": "x", "parameters": {"temperature": 0}})
    assert raw.status_code == 422
    assert raw.json() == {"error": "Input validation error: `temperature` must be strictly positive",
                          "error_type": "validation"}
    malformed = requests.post(default_server.url("/generate"), data=b"{", timeout=30)
    assert malformed.status_code == 400 and malformed.json()["error_type"] == "validation"


def test_raw_routes(default_server):
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}
    assert isinstance(requests.post(default_server.url("/generate"), json=body, timeout=60).json(), dict)
    assert isinstance(requests.post(default_server.url("/"), json=body, timeout=60).json(), list)
    assert requests.get(default_server.url("/health"), timeout=10).status_code == 200
    info = requests.get(default_server.url("/info"), timeout=10).json()
    assert {"model_id", "max_input_tokens", "max_total_tokens", "max_concurrent_requests", "version"} <= set(info)
    assert info["model_id"] == "smollm2-135m-instruct"
    unknown = requests.put(default_server.url("/generate"), timeout=10)
    assert unknown.status_code == 405 and "error" in unknown.json()


def test_async_client_concurrent_equals_sequential(client, default_server):
    sequential = [client.generate(p, max_new_tokens=12) for p in PROMPTS]

    async def together():
        async_client = AsyncClient(default_server.base, timeout=180)
        return await asyncio.gather(*(async_client.generate(p, max_new_tokens=12) for p in PROMPTS))

    concurrent = asyncio.run(together())
    for a, b in zip(sequential, concurrent):
        assert b.generated_text == a.generated_text
        assert [t.id for t in b.details.tokens] == [t.id for t in a.details.tokens]
