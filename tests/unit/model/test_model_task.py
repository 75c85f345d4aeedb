"""The task a model is served as, decided from its own config.json (model/task.py).

Each case is a tmp folder holding what transformers' own config classes write (`save_pretrained`
of a config: no weights needed), or a hand-written config.json for names transformers does not know.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from transformers import (BartConfig, BertConfig, GPT2Config, GPTNeoXConfig, LlamaConfig, OPTConfig, Qwen2Config,
                          T5Config)

from lmi_serve.config.sources import ModelConfig, load_model_config
from lmi_serve.model.task import ModelTaskError, TaskDecision, classify_config, decide_task
from lmi_serve.serving.service import ModelService, ModelStatus


def folder_with(tmp_path: Path, config, name: str = "model") -> Path:
    folder = tmp_path / name
    if isinstance(config, dict):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
    else:
        config.save_pretrained(folder)
    return folder


def decide(folder: Path, **options) -> TaskDecision:
    return decide_task(ModelConfig(name="m", model_id=str(folder), **options))


@pytest.mark.parametrize("config", [
    GPT2Config(architectures=["GPT2LMHeadModel"]),
    LlamaConfig(architectures=["LlamaForCausalLM"]),
    Qwen2Config(architectures=["Qwen2ForCausalLM"]),
    GPTNeoXConfig(architectures=["GPTNeoXForCausalLM"]),
    OPTConfig(architectures=["OPTForCausalLM"]),
], ids=lambda c: c.architectures[0])
def test_causal_lms_are_text_generation(tmp_path, config):
    decision = decide(folder_with(tmp_path, config))
    assert decision.task == "text-generation"
    assert decision.architectures == tuple(config.architectures) and decision.model_type == config.model_type
    assert decision.reason == f"architectures {config.architectures} are in transformers' causal-LM mapping"
    assert decision.refusal() is None
    decision.check_builtin()


def test_an_lm_head_model_is_no_embedding_model(tmp_path):
    """The defect: `GPT2LMHeadModel` ends with `Model`, and the old rule served it as text-embedding."""
    assert decide(folder_with(tmp_path, GPT2Config(architectures=["GPT2LMHeadModel"]))).task == "text-generation"


@pytest.mark.parametrize("config", [
    T5Config(architectures=["T5ForConditionalGeneration"]),
    BartConfig(architectures=["BartForConditionalGeneration"]),
], ids=lambda c: c.architectures[0])
def test_encoder_decoders_are_text2text_and_served_by_the_built_in_handler(tmp_path, config):
    decision = decide(folder_with(tmp_path, config))
    assert decision.task == "text2text-generation"
    assert "seq2seq-LM mapping" in decision.reason
    assert decision.refusal() is None
    decision.check_builtin()


@pytest.mark.parametrize("arch", ["BertModel", "BertForMaskedLM"])
def test_encoders_without_an_lm_head_are_embeddings(tmp_path, arch):
    decision = decide(folder_with(tmp_path, BertConfig(architectures=[arch])))
    assert decision.task == "text-embedding" and decision.architectures == (arch,)


def test_a_sentence_transformers_layout_is_embeddings(tmp_path):
    folder = folder_with(tmp_path, BertConfig(architectures=["BertModel"]))
    (folder / "modules.json").write_text("[]")
    decision = decide(folder)
    assert decision.task == "text-embedding" and "sentence-transformers layout (modules.json)" in decision.reason


def test_a_sentence_transformers_layout_wins_over_an_lm_head(tmp_path):
    folder = folder_with(tmp_path, Qwen2Config(architectures=["Qwen2ForCausalLM"]))
    (folder / "sentence_bert_config.json").write_text("{}")
    assert decide(folder).task == "text-embedding"


def test_an_unknown_architecture_fits_no_task_and_the_message_says_how_to_set_one(tmp_path):
    folder = folder_with(tmp_path, {"architectures": ["FrobnicatorNet"], "model_type": "frobnicator"})
    decision = decide(folder)
    assert decision.task is None and decision.architectures == ("FrobnicatorNet",)
    with pytest.raises(ModelTaskError) as info:
        decision.check_builtin()
    message = str(info.value)
    assert message.startswith("no task fits this model: architectures ['FrobnicatorNet'] are in none of")
    assert "model_type 'frobnicator'" in message
    assert "option.task=text-generation" in message and "HF_TASK" in message


def test_option_task_overrides_the_files(tmp_path):
    folder = folder_with(tmp_path, GPT2Config(architectures=["GPT2LMHeadModel"]))
    decision = decide(folder, task="text-embedding")
    assert decision.task == "text-embedding" and decision.architectures == ("GPT2LMHeadModel",)
    assert decision.reason.startswith("set by option.task=text-embedding")


def test_hf_task_sets_the_task_and_text2text_is_a_valid_value(tmp_path):
    folder = folder_with(tmp_path, GPT2Config(architectures=["GPT2LMHeadModel"]))
    config = load_model_config(None, {"HF_MODEL_ID": str(folder), "HF_TASK": "text2text-generation"})
    decision = decide_task(config)
    assert decision.task == "text2text-generation" and decision.refusal() is None


def test_option_task_can_name_a_task_for_an_unknown_architecture(tmp_path):
    folder = folder_with(tmp_path, {"architectures": ["FrobnicatorNet"], "model_type": "frobnicator"})
    decision = decide(folder, task="text-generation")
    assert decision.task == "text-generation" and decision.refusal() is None


@pytest.mark.parametrize("config, task", [
    ({"model_type": "t5"}, "text2text-generation"),
    ({"model_type": "bart"}, "text2text-generation"),  # also in the causal-LM mapping (BartForCausalLM)
    ({"model_type": "llama"}, "text-generation"),
    ({"model_type": "gpt2"}, "text-generation"),
    ({"model_type": "bert"}, "text-embedding"),  # BertLMHeadModel exists, but a bare BERT is an encoder
    ({"model_type": "frobnicator", "is_encoder_decoder": True}, "text2text-generation"),
    ({"model_type": "frobnicator"}, None),
])
def test_without_architectures_the_model_type_decides(tmp_path, config, task):
    decision = decide(folder_with(tmp_path, config))
    assert decision.task == task
    if task:
        assert decision.reason.startswith("config.json names no architectures, and ")


@pytest.mark.parametrize("config, task, words", [
    ({"architectures": ["MyOwnForCausalLM"]}, "text-generation", "end with ForCausalLM (LMI's suffix rule)"),
    ({"architectures": ["MyOwnLMHeadModel"]}, "text-generation", "end with LMHeadModel (LMI's suffix rule)"),
    ({"architectures": ["MyOwnForConditionalGeneration"], "is_encoder_decoder": True}, "text2text-generation",
     "config.json is encoder-decoder"),
    ({"architectures": ["MyOwnForConditionalGeneration"]}, "text-generation", "is not encoder-decoder"),
    ({"architectures": ["MyOwnModel"]}, "text-embedding", "end with Model"),
    ({"architectures": ["MyOwnForMaskedLM"]}, "text-embedding", "end with ForMaskedLM"),
])
def test_lmis_suffix_rule_decides_names_transformers_does_not_know(config, task, words):
    decision = classify_config(config)
    assert decision.task == task and words in decision.reason


def test_a_generation_head_beats_a_base_model_and_an_encoder_decoder_beats_a_decoder():
    assert classify_config({"architectures": ["BertModel", "BertLMHeadModel"]}).task == "text-generation"
    mixed = classify_config({"architectures": ["BartForCausalLM", "BartForConditionalGeneration"]})
    assert mixed.task == "text2text-generation"
    assert mixed.reason == "architectures ['BartForConditionalGeneration'] are in transformers' seq2seq-LM mapping"


def test_a_remote_code_auto_map_decides_when_nothing_else_does():
    config = {"architectures": ["Frob"], "model_type": "frob", "auto_map": {"AutoModelForCausalLM": "m.Frob"}}
    assert classify_config(config).task == "text-generation"
    config["auto_map"] = {"AutoConfig": "m.C", "AutoModelForSeq2SeqLM": "m.Frob"}
    assert classify_config(config).task == "text2text-generation"


def test_gguf_and_unresolved_sources_stay_text_generation(tmp_path):
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "tiny.Q4_0.gguf").write_bytes(b"GGUF")
    assert decide(tmp_path / "gguf").task == "text-generation"
    missing = decide_task(ModelConfig(name="m", model_id="package:no_such_package_here"))
    assert missing.task == "text-generation" and "not installed" in missing.reason
    hub = decide_task(ModelConfig(name="m", model_id="no-such-org/no-such-model"))
    assert hub.task == "text-generation" and "no readable config.json" in hub.reason
    assert decide_task(ModelConfig(name="m")).task == "text-generation"  # a model.py without model_id


@pytest.mark.parametrize("task", ["text-generation", "text2text-generation"])
def test_the_loader_keeps_an_encoder_decoder_whole_whatever_the_task(tmp_path, task, smollm2_tokenizer):
    """option.task=text-generation on a BART checkpoint once loaded BartForCausalLM (no encoder):
    the loader reads config.json and loads the seq2seq LM, and the service reaches READY."""
    import torch
    from transformers import BartForConditionalGeneration

    from lmi_serve.model.loader import load_generation_model

    folder = tmp_path / "bart"
    torch.manual_seed(0)
    BartForConditionalGeneration(BartConfig(
        vocab_size=len(smollm2_tokenizer), d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
        architectures=["BartForConditionalGeneration"])).save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    loaded = load_generation_model(str(folder))
    assert type(loaded.model).__name__ == "BartForConditionalGeneration"
    service = ModelService(ModelConfig(name="bart", model_id=str(folder), task=task), str(tmp_path / "cache"))
    service.load()
    assert service.current_status() is ModelStatus.READY, service.error
    assert service.generates_text and service.rolling_batch and service.engine.encoder_decoder
    service.engine.stop()


def test_a_model_py_of_its_own_serves_what_no_built_in_task_fits(tmp_path):
    """The refusals are the built-in handlers'; a model.py with handle() loads its model itself."""
    folder = folder_with(tmp_path, {"architectures": ["FrobnicatorNet"], "model_type": "frobnicator"})
    (folder / "model.py").write_text(textwrap.dedent("""
        PROPS = []

        def handle(inputs):
            PROPS.append(inputs.get_properties())
            return None
    """))
    service = ModelService(ModelConfig(name="own", model_dir=str(folder), model_id=str(folder)), "/tmp/cache")
    service.load()
    assert service.current_status() is ModelStatus.READY, service.error
    assert service.task == "text-generation" and service.task_decision.task is None
    assert service.capabilities.handle.__globals__["PROPS"][0]["task"] == "text-generation"
