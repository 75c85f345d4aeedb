"""An option a kind of model does not take (config_models.NOT_TAKEN): left out, and named in the
log, when an OPTION_* variable set it for every model of a store; refused by name when the user
set it for that model (its own serving.properties, or the only model served)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmi_serve.__main__ import DEFAULT_STORE
from lmi_serve.config.models import NOT_TAKEN
from lmi_serve.config.sources import ConfigError, build_server_config

EMBEDDING = "option.model_id=org/minilm\noption.task=text-embedding\n"
TEXT = "option.model_id=org/tiny\noption.task=text-generation\n"
SEQ2SEQ = "option.model_id=org/t5\noption.task=text2text-generation\n"


def store(root: Path, **folders: str) -> Path:
    for name, properties in folders.items():
        (root / name).mkdir(parents=True)
        (root / name / "serving.properties").write_text(properties)
    return root


def models(config) -> dict:
    return {m.name: m for m in config.models}


def test_an_environment_option_for_the_text_model_leaves_the_default_embedding_model_alone():
    config = build_server_config({"OPTION_QUANTIZE": "fp16"}, default_store=DEFAULT_STORE)
    served = models(config)
    assert served["smollm2-135m-instruct"].quantize == "fp16"
    embedding = served["all-minilm-l6-v2"]
    assert (embedding.quantize, embedding.ignored_options) == ("none", ("OPTION_QUANTIZE",))
    assert "quantize" not in embedding.options and embedding.handler_properties()["quantize"] == "none"
    assert served["smollm2-135m-instruct"].ignored_options == ()
    assert "ignored (not for embedding models) = OPTION_QUANTIZE" in config.describe()


@pytest.mark.parametrize("kind, properties", [("text-embedding", EMBEDDING), ("text2text-generation", SEQ2SEQ)])
def test_every_option_a_kind_does_not_take_is_left_out_for_it_in_a_store(tmp_path, kind, properties):
    for field in NOT_TAKEN[kind]:
        variable = f"OPTION_{field.upper()}"
        value = {"quantize": "fp16", "draft_model_id": "ngram", "decode_attention": "sdpa",
                 "mixed_steps": "false", "row_kernel": "on", "chat_template": "{{ messages }}"}.get(field, "true")
        root = tmp_path / field
        # option.quantize_lm_head needs option.quantize=q4 beside it (both left out for the other kind)
        needs = {"OPTION_QUANTIZE": "q4"} if field == "quantize_lm_head" else {}
        served = models(build_server_config({variable: value, **needs},
                                            model_store=store(root, text=TEXT, other=properties)))
        assert set(served["other"].ignored_options) == {variable, *needs}
        assert str(getattr(served["text"], field)).lower() == value


def test_an_option_in_the_models_own_properties_is_refused_by_name(tmp_path):
    root = store(tmp_path, text=TEXT, embed=EMBEDDING + "option.quantize=fp16\n")
    with pytest.raises(ConfigError, match=r"^option.quantize: not available for embedding models .*model folder"):
        build_server_config({}, model_store=root)


def test_the_environment_naming_the_only_model_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="^OPTION_ENABLE_PREFIX_CACHING: not available for embedding models"):
        build_server_config({"OPTION_ENABLE_PREFIX_CACHING": "true"}, model_store=store(tmp_path, embed=EMBEDDING))
    folder = store(tmp_path / "dir", embed=EMBEDDING) / "embed"
    with pytest.raises(ConfigError, match="^OPTION_QUANTIZE: not available for embedding models"):
        build_server_config({"OPTION_QUANTIZE": "fp16"}, model_dir=folder)


def test_a_model_whose_kind_is_decided_at_load_keeps_the_option_for_its_handler_to_judge(tmp_path):
    root = store(tmp_path, text=TEXT, undeclared="option.model_id=org/unknown\n")
    served = models(build_server_config({"OPTION_QUANTIZE": "fp16"}, model_store=root))
    assert (served["undeclared"].quantize, served["undeclared"].ignored_options) == ("fp16", ())

