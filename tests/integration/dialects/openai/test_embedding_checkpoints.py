"""The real server with two sentence-transformers checkpoints of the zoo (tests/tiny_embedders.py): a CLS
model with two Dense layers and a decoder-only last-token model with an instruction prompt. Through the
official `openai` client and LMI's /invocations, alone and as concurrent requests sharing forwards,
every vector is `SentenceTransformer(folder).encode()`'s; `prompt_name` and `dimensions` are honoured,
and what cannot be is a 400 naming the field. On the shared tiny-model server (integration/conftest.py)."""

from __future__ import annotations

import threading

import openai
import pytest
import requests
import torch

pytestmark = pytest.mark.integration

COSINE = 0.99999
TEXTS = ["Where do rivers begin?", "Most rivers start as small streams high in the mountains, fed by rain and snow.",
         "ok"]


@pytest.fixture(scope="module")
def server(tiny_models_server):
    return tiny_models_server


@pytest.fixture(scope="module")
def client(server, openai_client):
    return openai_client(server)


def reference(folder, texts, **kwargs) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return torch.as_tensor(SentenceTransformer(str(folder), device="cpu").encode(texts, **kwargs))


def assert_same(vectors, expected) -> None:
    cosine = torch.nn.functional.cosine_similarity(torch.tensor(vectors), expected.float(), dim=-1)
    assert cosine.min().item() >= COSINE, cosine


def embed(client, model, texts, **extra) -> list[list[float]]:
    response = client.embeddings.create(model=model, input=texts, encoding_format="float", extra_body=extra or None)
    return [d.embedding for d in response.data]


@pytest.mark.parametrize("name", ["emb-cls-dense", "emb-decoder"])
def test_vectors_are_the_checkpoints_own_through_openai_and_invocations(server, client, embedders, name):
    expected = reference(embedders[name], TEXTS)
    assert_same(embed(client, name, TEXTS), expected)
    answer = requests.post(server.url(f"/predictions/{name}"), json={"inputs": TEXTS}, timeout=120)
    assert answer.status_code == 200, answer.text
    assert_same(answer.json(), expected)


def test_a_named_prompt_is_applied_and_counted(client, embedders):
    folder = embedders["emb-decoder"]
    plain = client.embeddings.create(model="emb-decoder", input=TEXTS[0], encoding_format="float")
    prompted = client.embeddings.create(model="emb-decoder", input=TEXTS[0], encoding_format="float",
                                        extra_body={"prompt_name": "query"})
    assert prompted.usage.prompt_tokens > plain.usage.prompt_tokens
    assert_same([prompted.data[0].embedding], reference(folder, TEXTS[:1], prompt_name="query"))
    with pytest.raises(openai.BadRequestError) as caught:
        embed(client, "emb-decoder", TEXTS, prompt_name="passage")
    assert caught.value.param == "prompt_name" and "passage" in caught.value.message


def test_concurrent_requests_with_different_prompts_keep_their_vectors(client, embedders):
    folder = embedders["emb-decoder"]
    expected = {None: reference(folder, TEXTS), "query": reference(folder, TEXTS, prompt_name="query")}
    jobs = [None, "query"] * 4
    got: list = [None] * len(jobs)

    def ask(i: int) -> None:
        got[i] = embed(client, "emb-decoder", TEXTS, **({"prompt_name": jobs[i]} if jobs[i] else {}))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for prompt, vectors in zip(jobs, got):
        assert_same(vectors, expected[prompt])


def test_dimensions_keep_the_first_components_renormalised(client):
    full = torch.tensor(embed(client, "emb-cls-dense", TEXTS))
    assert full.shape[1] == 32  # the last Dense layer's width, not the transformer's
    short = torch.tensor(embed(client, "emb-cls-dense", TEXTS, dimensions=12))
    torch.testing.assert_close(short, torch.nn.functional.normalize(full[:, :12], dim=-1))
    with pytest.raises(openai.BadRequestError) as caught:
        embed(client, "emb-cls-dense", TEXTS, dimensions=33)
    assert caught.value.param == "dimensions"


def test_triton_metadata_gives_the_width_after_the_dense_layers(server):
    meta = requests.get(server.url("/v2/models/emb-cls-dense"), timeout=10).json()
    assert [(o["name"], o["shape"]) for o in meta["outputs"]] == [("embedding", [-1, 32])]
