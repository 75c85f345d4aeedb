"""Vision-language checkpoints: the task rules serve the checked families as text generation with
images, loaded with their processor; any other VLM family is refused at load, naming the served ones.
Checkpoints are tiny random models saved with save_pretrained (tests/tiny_vlm.py)."""

from __future__ import annotations

import pytest

import tiny_vlm
from lmi_serve.config.sources import ModelConfig
from lmi_serve.model.loader import ModelLoadError, load_generation_model
from lmi_serve.model.task import ModelTaskError, TEXT_GENERATION, classify_config, decide_task


@pytest.fixture(scope="module")
def folders(tmp_path_factory, smollm2_tokenizer):
    root = tmp_path_factory.mktemp("vlm")
    return {family: tiny_vlm.vlm_folder(family, root / family, smollm2_tokenizer) for family in tiny_vlm.FAMILIES}


@pytest.mark.parametrize("family, architecture", [("idefics3", "Idefics3ForConditionalGeneration"),
                                                  ("llava", "LlavaForConditionalGeneration")])
def test_a_served_family_loads_with_its_processor(folders, family, architecture):
    decision = decide_task(ModelConfig(name="vlm", model_id=str(folders[family])))
    assert decision.task == TEXT_GENERATION and decision.images, decision.explained()
    decision.check_builtin()
    loaded = load_generation_model(str(folders[family]))
    assert type(loaded.model).__name__ == architecture
    assert loaded.processor is not None and loaded.tokenizer is loaded.processor.tokenizer
    assert "<image>" in loaded.tokenizer.get_vocab()  # the placeholder the processor expands
    image = tiny_vlm.image(0)
    inputs = loaded.processor(text="<image>What is it?", images=[image], return_tensors="pt")
    assert "pixel_values" in inputs and (inputs.input_ids == loaded.model.config.image_token_id).sum() > 1


def test_text_models_load_without_a_processor(tmp_path, smollm2_model_dir):
    loaded = load_generation_model(str(smollm2_model_dir))
    assert loaded.processor is None


def test_another_vlm_family_is_refused_naming_the_served_ones(tmp_path):
    import transformers as tf

    folder = tmp_path / "qwen2vl"
    tf.Qwen2VLConfig(architectures=["Qwen2VLForConditionalGeneration"]).save_pretrained(folder)
    decision = decide_task(ModelConfig(name="vlm", model_id=str(folder)))
    assert decision.task is None
    with pytest.raises(ModelTaskError, match="Idefics3ForConditionalGeneration.*LlavaForConditionalGeneration"):
        decision.check_builtin()
    with pytest.raises(ModelLoadError, match="Qwen2VLForConditionalGeneration.*not checked.*LLaVA"):
        load_generation_model(str(folder))  # option.task=text-generation reaches the loader: refused there too


def test_vlms_that_transformers_also_serves_as_causal_lms_stay_text_models():
    """Gemma 3 is in both mappings: served as today (text), not refused."""
    decision = classify_config({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"})
    assert decision.task == TEXT_GENERATION and not decision.images
