"""The built-in text-classification handler (serving/handlers/classifier.py): transformers' pipeline
request and answer shapes, the activations of serving/classification.py, and a dynamic batch of
texts and pairs giving each input transformers' own logits."""

from __future__ import annotations

import json
import math

import pytest
from tiny_classifier import SENTIMENT_LABELS, bge_shaped_reranker, reference_logits, reranker, sentiment

from lmi_serve.config.sources import ModelConfig
from lmi_serve.handler_api import Input
from lmi_serve.serving.classification import activate, head_from_config
from lmi_serve.serving.handler_protocol import HandlerContext
from lmi_serve.serving.handlers import classifier

TOLERANCE = 1e-5  # padded float32 rows against unpadded ones


@pytest.fixture(scope="module")
def sentiment_service(tmp_path_factory):
    folder = sentiment(tmp_path_factory.mktemp("sentiment") / "m")
    return folder, classifier.ClassifierService(ModelConfig(name="s", model_id=str(folder)))


@pytest.fixture(scope="module")
def reranker_service(tmp_path_factory):
    folder = reranker(tmp_path_factory.mktemp("reranker") / "m")
    return folder, classifier.ClassifierService(ModelConfig(name="r", model_id=str(folder)))


def ask(service, *bodies):
    """The handler's answer per body, the bodies sent as one dynamic batch."""
    items = [Input.from_http(json.dumps(b).encode(), {"Content-Type": "application/json"}, [], "") for b in bodies]
    output = service.inference(Input.batch_of(items) if len(items) > 1 else items[0])
    if len(items) == 1:
        return [json.loads(output.body())]
    return [json.loads(o.body()) for o in output.get_batch_outputs(len(items))]


def test_heads_follow_transformers_and_vllm():
    one = head_from_config({"num_labels": 1})
    assert one == classifier.ClassifierHead(("LABEL_0",), "sigmoid", "sigmoid", "sigmoid")
    two = head_from_config({"id2label": {"0": "NEG", "1": "POS"}})
    assert (two.labels, two.pipeline_activation, two.classify_activation, two.score_activation) == (
        ("NEG", "POS"), "softmax", "softmax", "softmax")
    ms_marco = head_from_config({"num_labels": 1,
                                 "sbert_ce_default_activation_function": "torch.nn.modules.linear.Identity"})
    assert ms_marco.score_activation == "none" and ms_marco.classify_activation == "sigmoid"
    st = head_from_config({"num_labels": 1,
                           "sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Sigmoid"}})
    assert st.score_activation == "sigmoid"
    declared = {"activation_fn": "torch.nn.modules.activation.Sigmoid"}
    assert head_from_config({"num_labels": 3, "sentence_transformers": declared}).score_activation == "sigmoid"
    with pytest.raises(ValueError, match="Tanh"):
        head_from_config({"num_labels": 1, "sentence_transformers": {"activation_fn": "torch.nn.Tanh"}})
    multi = head_from_config({"num_labels": 3, "problem_type": "multi_label_classification"})
    assert multi.classify_activation == multi.pipeline_activation == "sigmoid"
    assert head_from_config({"num_labels": 1, "problem_type": "regression"}).classify_activation == "none"


def test_activations():
    assert activate([0.0], "sigmoid") == [0.5]
    assert activate([1000.0, -1000.0], "sigmoid") == [1.0, 0.0]  # no overflow
    probs = activate([1.0, 2.0], "softmax")
    assert math.isclose(sum(probs), 1.0) and math.isclose(probs[1], 1 / (1 + math.exp(-1)))
    assert activate([3.5], "none") == [3.5]


@pytest.mark.parametrize("payload, problem", [
    ({"inputs": []}, "must not be an empty list"),
    ({"inputs": "a", "parameters": {"max_new_tokens": 5}}, "text-generation parameters do not apply"),
    ({"inputs": "a", "parameters": {"top_k": 0}}, "top_k must be a positive integer"),
    ({"inputs": "a", "parameters": {"function_to_apply": "tanh"}}, "function_to_apply must be one of"),
    ({"inputs": [{"text": "q", "pair": "d"}]}, "a pair is"),
    ({"inputs": [3]}, "inputs[0] must be a text"),
    ({"inputs": "a", "stream": True}, "Unsupported field(s) ['stream']"),
])
def test_bad_requests_are_refused_by_name(payload, problem):
    with pytest.raises(ValueError) as caught:
        classifier.parse_request(payload)
    assert problem in str(caught.value)


def test_pipeline_answer_shapes(sentiment_service):
    folder, service = sentiment_service
    text = "I loved this film"
    probs = activate(reference_logits(folder, [text])[0], "softmax")
    best = max(range(2), key=probs.__getitem__)
    top = {"label": SENTIMENT_LABELS[best], "score": pytest.approx(probs[best], abs=TOLERANCE)}
    (answer,) = ask(service, text)  # a bare text: the pipeline's one-element list
    assert answer == [top]
    (answer,) = ask(service, {"inputs": [text, text]})
    assert answer == [top, top]
    (answer,) = ask(service, {"inputs": text, "parameters": {"top_k": None}})
    assert [e["label"] for e in answer] == [SENTIMENT_LABELS[best], SENTIMENT_LABELS[1 - best]]
    (answer,) = ask(service, {"inputs": [text], "parameters": {"return_all_scores": True}})
    assert [[e["label"] for e in row] for row in answer] == [["NEGATIVE", "POSITIVE"]]  # label order
    (answer,) = ask(service, {"inputs": text, "parameters": {"function_to_apply": "none", "top_k": 1}})
    assert answer[0]["score"] == pytest.approx(max(reference_logits(folder, [text])[0]), abs=TOLERANCE)


def test_a_batch_of_texts_and_pairs_matches_transformers_forward(reranker_service):
    folder, service = reranker_service
    query = "what is the capital of France?"
    documents = ["Paris is the capital of France.", "Berlin is in Germany. " * 20, "Cheese.", "France " * 3]
    raw = {"function_to_apply": "none", "return_all_scores": True}
    bodies = [{"inputs": [{"text": query, "text_pair": d} for d in documents], "parameters": raw},
              {"inputs": documents, "parameters": raw}, {"inputs": "bad", "parameters": {"top_k": -1}}]
    pairs_answer, texts_answer, bad = ask(service, *bodies)
    for answer, want in ((pairs_answer, reference_logits(folder, [query] * 4, documents)),
                         (texts_answer, reference_logits(folder, documents))):
        assert [row[0]["score"] for row in answer] == pytest.approx([w[0] for w in want], abs=TOLERANCE)
    assert "top_k" in bad["error"]  # one bad request fails alone
    lengths = service.count_tokens([(query, documents[0]), (documents[2], None)])
    tokenizer = service.tokenizer
    assert lengths == [len(tokenizer(query, documents[0]).input_ids), len(tokenizer(documents[2]).input_ids)]


def test_the_module_api_serves_the_head_and_counts(reranker_service, monkeypatch):
    folder, service = reranker_service
    monkeypatch.setattr(classifier, "_service", service)
    assert classifier.classifier_head().labels == ("LABEL_0",)
    assert classifier.count_tokens([("a", "b")]) == [5]  # [CLS] a [SEP] b [SEP]


def test_options_a_classifier_does_not_take_are_refused(tmp_path):
    with pytest.raises(ValueError, match="option.quantize"):
        classifier.load(ModelConfig(name="c", model_id=str(tmp_path), quantize="fp16"),
                        HandlerContext(task="text-classification", cache_dir=str(tmp_path), rolling_batch=False))


def test_an_xlm_roberta_reranker_without_token_types_matches_transformers(tmp_path):
    """bge-reranker-base's shape: XLMRobertaForSequenceClassification, a tokenizer with no token types."""
    folder = bge_shaped_reranker(tmp_path / "bge")
    service = classifier.ClassifierService(ModelConfig(name="b", model_id=str(folder)))
    query, documents = "what is a panda?", ["The giant panda is a bear.", "hi", "Pandas eat bamboo " * 30]
    assert "token_type_ids" not in service.encode([(query, documents[0])])[0]
    logits = service.logits([(query, d) for d in documents])
    want = reference_logits(folder, [query] * 3, documents)
    assert [row[0] for row in logits] == pytest.approx([w[0] for w in want], abs=TOLERANCE)


@pytest.mark.parametrize("activation", ["torch.nn.modules.linear.Identity", "torch.nn.modules.activation.Sigmoid"])
def test_scores_are_cross_encoder_predict_for_the_checkpoints_own_activation(tmp_path, activation):
    """The score route's numbers (logits, then the head's score activation) equal
    `sentence_transformers.CrossEncoder(folder).predict()`, for a checkpoint of two labels (where the
    declared Sigmoid is applied per label, not vLLM's softmax default)."""
    import json

    from sentence_transformers import CrossEncoder

    from tiny_classifier import write_classifier

    folder = write_classifier(tmp_path / "ce", num_labels=2, seed=5)
    config = json.loads((folder / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": activation}
    (folder / "config.json").write_text(json.dumps(config))
    pairs = [("what is a river", "a river is a stream of water"), ("hello", "a long text " * 20)]
    expected = CrossEncoder(str(folder), device="cpu").predict(pairs)
    service = classifier.ClassifierService(ModelConfig(name="ce", model_id=str(folder)))
    served = [activate(row, service.head.score_activation) for row in service.logits(pairs)]
    assert max(abs(a - b) for row, ref in zip(served, expected) for a, b in zip(row, ref)) < 1e-5
