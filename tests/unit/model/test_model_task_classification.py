"""`*ForSequenceClassification` models (cross-encoder rerankers such as ms-marco-MiniLM and
bge-reranker, sentiment classifiers) are text-classification, decided from config.json (model/task.py)."""

from __future__ import annotations

import pytest
from transformers import BertConfig, DistilBertConfig, XLMRobertaConfig

from lmi_serve.config.sources import ModelConfig
from lmi_serve.model.task import classify_config, decide_task
from lmi_serve.serving.handler_loader import builtin_handler_path
from lmi_serve.serving.service import ENCODER_BATCHING


@pytest.mark.parametrize("config", [
    BertConfig(architectures=["BertForSequenceClassification"], num_labels=1),  # ms-marco-MiniLM-L-6-v2
    XLMRobertaConfig(architectures=["XLMRobertaForSequenceClassification"], num_labels=1),  # bge-reranker-base
    DistilBertConfig(architectures=["DistilBertForSequenceClassification"],  # a sentiment classifier
                     id2label={0: "NEGATIVE", 1: "POSITIVE"}),
], ids=lambda c: c.architectures[0])
def test_sequence_classifiers_are_text_classification(tmp_path, config):
    config.save_pretrained(tmp_path / "m")
    decision = decide_task(ModelConfig(name="m", model_id=str(tmp_path / "m")))
    assert decision.task == "text-classification"
    assert decision.reason == (f"architectures {config.architectures} are in transformers' sequence-classification "
                               "mapping (rerankers, classifiers)")
    decision.check_builtin()
    assert builtin_handler_path(decision.task).name == "classifier.py"


def test_names_transformers_does_not_know_and_remote_code_follow_the_suffix_and_auto_map():
    assert classify_config({"architectures": ["MyRerankerForSequenceClassification"]}).task == "text-classification"
    remote = {"architectures": ["Custom"],
              "auto_map": {"AutoModelForSequenceClassification": "m.C", "AutoModel": "m.B"}}
    assert classify_config(remote).task == "text-classification"
    both = classify_config({"architectures": ["BertModel", "BertForSequenceClassification"]})
    assert both.task == "text-classification"  # the head is not dropped for embeddings


def test_classifiers_batch_like_embeddings():
    assert ENCODER_BATCHING["text-classification"] == ENCODER_BATCHING["text-embedding"] == {
        "batch_size": 32, "max_batch_delay": 0}


def test_option_task_accepts_text_classification_and_refuses_generation_options():
    assert ModelConfig(name="m", task="text-classification").task == "text-classification"
    with pytest.raises(ValueError, match="quantize"):
        ModelConfig(name="m", task="text-classification", quantize="fp16")
