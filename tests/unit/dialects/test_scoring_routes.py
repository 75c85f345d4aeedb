"""vLLM's /score, /rerank and /classify (dialects/openai/scoring.py) on the whole app, over two tiny real
models served by the built-in classifier handler: a one-label cross-encoder and a two-label sentiment
classifier. Shapes, pairing rules, refusals in OpenAI's envelope, and scores equal to transformers'
own forward under vLLM's activation."""

from __future__ import annotations

import math

import pytest
from tiny_classifier import reference_logits, sigmoid, two_classifiers

from lmi_serve.config.sources import ModelConfig, ServerConfig
from lmi_serve.server.app import create_app
from lmi_serve.serving.registry import ModelRegistry
from lmi_serve.serving.service import ModelService, ModelStatus

TOLERANCE = 1e-5
QUERY = "what is the capital of France?"
DOCUMENTS = ["Paris is the capital of France.", "Berlin is a city in Germany.", "Cheese and wine.",
             "The capital of France is a large city on the Seine."]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return two_classifiers(tmp_path_factory.mktemp("classifiers"))


@pytest.fixture(scope="module")
def client(models, tmp_path_factory):
    configs = [ModelConfig(name=name, model_id=str(folder)) for name, folder in models.items()]
    services = [ModelService(c, str(tmp_path_factory.mktemp("cache"))) for c in configs]
    for service in services:
        service.load()
        assert service.status is ModelStatus.READY, service.error
        assert service.task == "text-classification"
    app = create_app(ServerConfig(models=tuple(configs)), ModelRegistry(services))
    return app.test_client()  # the batchers' threads are daemons


def assert_400(response, param, *words):
    assert response.status_code == 400, response.get_data(as_text=True)
    error = response.get_json()["error"]
    # a union's branch may follow the field (`input.str`)
    assert error["type"] == "invalid_request_error" and error["param"].split(".")[0] == param, error
    for word in words:
        assert word in error["message"]


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_sorts_documents_by_the_cross_encoders_score(client, models, path):
    want = [sigmoid(row[0]) for row in reference_logits(models["rr"], [QUERY] * len(DOCUMENTS), DOCUMENTS)]
    body = client.post(path, json={"model": "rr", "query": QUERY, "documents": DOCUMENTS}).get_json()
    assert set(body) == {"id", "model", "usage", "results"} and body["model"] == "rr"
    order = sorted(range(len(DOCUMENTS)), key=lambda i: want[i], reverse=True)
    assert [r["index"] for r in body["results"]] == order
    for result in body["results"]:
        assert result["relevance_score"] == pytest.approx(want[result["index"]], abs=TOLERANCE)
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    assert body["usage"]["total_tokens"] > len(DOCUMENTS) * 5


def test_rerank_top_n_document_objects_and_return_documents(client, models):
    documents = [{"text": d} for d in DOCUMENTS]
    body = client.post("/rerank", json={"query": QUERY, "documents": documents, "top_n": 2,
                                        "return_documents": False}).get_json()
    assert len(body["results"]) == 2 and all(set(r) == {"index", "relevance_score"} for r in body["results"])
    everything = client.post("/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 0}).get_json()
    assert [r["index"] for r in everything["results"]][:2] == [r["index"] for r in body["results"]]
    raw = client.post("/rerank", json={"query": QUERY, "documents": DOCUMENTS[:1], "use_activation": False})
    logit = reference_logits(models["rr"], [QUERY], DOCUMENTS[:1])[0][0]
    assert raw.get_json()["results"][0]["relevance_score"] == pytest.approx(logit, abs=TOLERANCE)


def test_score_pairs_one_to_one_one_to_many_and_many_to_many(client, models):
    want = [sigmoid(row[0]) for row in reference_logits(models["rr"], [QUERY] * 2, DOCUMENTS[:2])]
    for text_1 in (QUERY, [QUERY], [QUERY, QUERY]):
        body = client.post("/score", json={"model": "rr", "text_1": text_1, "text_2": DOCUMENTS[:2]}).get_json()
        assert body["object"] == "list" and body["model"] == "rr"
        assert [d["index"] for d in body["data"]] == [0, 1] and {d["object"] for d in body["data"]} == {"score"}
        assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=TOLERANCE)
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    one = client.post("/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS[0]}).get_json()
    assert [d["score"] for d in one["data"]] == pytest.approx(want[:1], abs=TOLERANCE)


def test_classify_gives_softmax_probs_and_the_top_label(client, models):
    texts = ["I loved it", "a dull and boring film"]
    body = client.post("/classify", json={"model": "senti", "input": texts}).get_json()
    assert body["object"] == "list" and len(body["data"]) == 2
    for item, logits in zip(body["data"], reference_logits(models["senti"], texts)):
        exps = [math.exp(x) for x in logits]
        probs = [e / sum(exps) for e in exps]
        assert item["probs"] == pytest.approx(probs, abs=TOLERANCE) and item["num_classes"] == 2
        assert item["label"] == ["NEGATIVE", "POSITIVE"][probs.index(max(probs))]
    assert client.post("/v1/classify", json={"model": "senti", "input": "ok"}).status_code == 200


@pytest.mark.parametrize("path, body, param, words", [
    ("/rerank", {"model": "rr", "query": "q", "documents": []}, "documents", ["documents must not be empty"]),
    ("/rerank", {"model": "rr", "query": "q", "documents": ["d"], "top_n": -1}, "top_n", ["top_n"]),
    ("/rerank", {"model": "rr", "documents": ["d"]}, "query", ["query"]),
    ("/v2/rerank", {"model": "senti", "query": "q", "documents": ["d"]}, "model", ["2 labels", "/classify"]),
    ("/score", {"model": "rr", "text_1": ["a", "b", "c"], "text_2": ["x", "y"]}, "text_2", ["1:1, 1:N or N:N"]),
    ("/score", {"model": "rr", "text_1": [], "text_2": ["x"]}, "text_1", ["at least one"]),
    ("/score", {"model": "rr", "text_1": "a", "text_2": []}, "text_2", ["at least one"]),
    ("/score", {"model": "rr", "text_1": "a", "text_2": "b", "truncate_prompt_tokens": 5},
     "truncate_prompt_tokens", ["model's limit"]),
    ("/score", {"model": "rr", "text_1": "a", "text_2": "b", "priority": 1}, "priority", ["first come"]),
    ("/classify", {"model": "senti", "input": []}, "input", ["must not be an empty list"]),
    ("/classify", {"model": "senti", "input": [1, 2]}, "input", []),
    ("/v1/completions", {"model": "rr", "prompt": "hi"}, "model", ["serves text-classification"]),
    ("/v1/embeddings", {"model": "rr", "input": "hi"}, "model", ["serves text-classification"]),
])
def test_bad_requests_are_400_naming_the_field(client, path, body, param, words):
    assert_400(client.post(path, json=body), param, *words)


def test_unknown_models_and_methods_answer_in_openais_envelope(client):
    missing = client.post("/rerank", json={"model": "nope", "query": "q", "documents": ["d"]})
    assert missing.status_code == 404 and missing.get_json()["error"]["code"] == "model_not_found"
    for path in ("/v2/rerank", "/score", "/classify"):
        wrong = client.get(path)
        assert wrong.status_code == 405 and "error" in wrong.get_json() and "message" in wrong.get_json()["error"]


def test_models_are_listed_and_invocations_take_the_pipeline_shape(client, models):
    assert {m["id"] for m in client.get("/v1/models").get_json()["data"]} == {"rr", "senti"}
    pairs = [{"text": QUERY, "text_pair": d} for d in DOCUMENTS[:2]]
    answer = client.post("/invocations?model_name=rr", json={"inputs": pairs}).get_json()
    want = reference_logits(models["rr"], [QUERY] * 2, DOCUMENTS[:2])
    assert [a["label"] for a in answer] == ["LABEL_0"] * 2
    assert [a["score"] for a in answer] == pytest.approx([sigmoid(w[0]) for w in want], abs=TOLERANCE)
    refused = client.post("/invocations?model_name=senti", json={"inputs": "hi", "parameters": {"max_new_tokens": 3}})
    assert refused.status_code == 424 and "text-generation parameters do not apply" in refused.get_data(as_text=True)


def test_triton_infer_scores_texts_and_pairs(client, models):
    body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [2], "data": [QUERY, QUERY]},
                       {"name": "text_pair", "datatype": "BYTES", "shape": [2], "data": DOCUMENTS[:2]}]}
    response = client.post("/v2/models/rr/infer", json=body)
    assert response.status_code == 200, response.get_data(as_text=True)
    outputs = {o["name"]: o for o in response.get_json()["outputs"]}
    want = reference_logits(models["rr"], [QUERY] * 2, DOCUMENTS[:2])
    assert outputs["logits"]["shape"] == [2, 1] and outputs["logits"]["datatype"] == "FP32"
    assert outputs["logits"]["data"] == pytest.approx([w[0] for w in want], abs=TOLERANCE)
    assert outputs["scores"]["data"] == pytest.approx([sigmoid(w[0]) for w in want], abs=TOLERANCE)
    meta = client.get("/v2/models/senti").get_json()
    assert [(o["name"], o["shape"]) for o in meta["outputs"]] == [("logits", [-1, 2]), ("scores", [-1, 2])]
    texts = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["I loved it"]}]}
    senti = {o["name"]: o for o in client.post("/v2/models/senti/infer", json=texts).get_json()["outputs"]}
    assert senti["scores"]["shape"] == [1, 2] and sum(senti["scores"]["data"]) == pytest.approx(1.0, abs=1e-6)
    body["inputs"][1]["shape"], body["inputs"][1]["data"] = [1], DOCUMENTS[:1]
    mismatch = client.post("/v2/models/rr/infer", json=body)
    assert mismatch.status_code == 400 and "one pair per text" in mismatch.get_json()["error"]


def test_generation_routes_of_a_classifier_are_400_in_their_dialect(client):
    tgi = client.post("/generate?model_name=rr", json={"inputs": "hi"})
    assert tgi.status_code == 422 and set(tgi.get_json()) == {"error", "error_type"}  # TGI validation status
    assert "serves text-classification, not text generation" in tgi.get_json()["error"]
    chat = client.post("/v1/chat/completions", json={"model": "senti", "messages": [{"role": "user", "content": "x"}]})
    assert chat.status_code == 400 and "serves text-classification" in chat.get_json()["error"]["message"]
