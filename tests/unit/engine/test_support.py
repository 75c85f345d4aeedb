"""support.check_supported: what the engine cannot serve exactly is refused when the model loads,
with a message naming the model type and what cannot be served; it never answers wrong text.

Models are built on the meta device (no weights, instant) except where one must really load.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from lmi_serve.config.sources import ModelConfig
from lmi_serve.engine.engine import Engine
from lmi_serve.engine.support import UnsupportedModel, check_supported, layer_types
from lmi_serve.serving.service import ModelService, ModelStatus

CPU = torch.device("cpu")
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def on_meta(model_class, config):
    with torch.device("meta"):
        return model_class(config)


def qwen3_next(vocab: int = 64):
    return tf.Qwen3NextConfig(**{**SMALL, "vocab_size": vocab}, head_dim=8,
                              layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
                              linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=2,
                              num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16)


def made_up_layer():
    config = tf.LlamaConfig(**SMALL)
    config.layer_types = ["full_attention", "made_up_attention"]  # set after the config validated its names
    return config


def legacy_layer_names(names):
    def config():
        built = tf.LlamaConfig(**SMALL)
        built.layer_types = names
        return built
    return config


SERVED = {
    "llama": (tf.LlamaForCausalLM, lambda: tf.LlamaConfig(**SMALL)),
    "mistral (sliding window)": (tf.MistralForCausalLM, lambda: tf.MistralConfig(**SMALL, sliding_window=8)),
    "gemma2 (local/global)": (tf.Gemma2ForCausalLM, lambda: tf.Gemma2Config(**SMALL, head_dim=8)),
    "llama4 (chunked attention)": (tf.Llama4ForCausalLM, lambda: tf.Llama4TextConfig(
        **SMALL, head_dim=8, intermediate_size_mlp=64, num_local_experts=2, attention_chunk_size=8)),
    "bloom (ALiBi, no position ids)": (tf.BloomForCausalLM, lambda: tf.BloomConfig(
        vocab_size=64, hidden_size=32, n_layer=2, n_head=4)),
    "legacy name 'attention'": (tf.LlamaForCausalLM, legacy_layer_names(["attention", "attention"])),
    "t5 (encoder-decoder, relative positions)": (tf.T5ForConditionalGeneration, lambda: tf.T5Config(
        vocab_size=64, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8)),
    "bart (encoder-decoder, position embeddings)": (tf.BartForConditionalGeneration, lambda: tf.BartConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)),
}

# (model class, config factory, fragments the message must contain)
REFUSED = {
    "hybrid linear attention": (tf.Qwen3NextForCausalLM, qwen3_next, ["'qwen3_next'", "'linear_attention' layers"]),
    "mamba": (tf.MambaForCausalLM, lambda: tf.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2),
              ["'mamba'", "takes no past_key_values"]),
    "jamba (attention + mamba)": (tf.JambaForCausalLM, lambda: tf.JambaConfig(
        **SMALL, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
        num_experts=2, mamba_d_state=4, mamba_expand=1), ["'jamba'", "'linear_attention' layers"]),
    "lfm2 (convolution layers)": (tf.Lfm2ForCausalLM, lambda: tf.Lfm2Config(
        **{k: v for k, v in SMALL.items() if k != "intermediate_size"}, intermediate_size=64,
        full_attn_idxs=[1]), ["'lfm2'", "'conv' layers"]),
    "a made-up layer type": (tf.LlamaForCausalLM, made_up_layer, ["'llama'", "'made_up_attention' layers"]),
    "legacy name 'mamba'": (tf.LlamaForCausalLM, legacy_layer_names(["attention", "mamba"]),
                            ["'linear_attention' layers"]),
    "a cache of its own": (tf.RwkvForCausalLM, lambda: tf.RwkvConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64),
        ["'rwkv'", "needs its own cache class"]),
    "an encoder-decoder family not checked": (tf.M2M100ForConditionalGeneration, lambda: tf.M2M100Config(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64),
        ["'m2m_100'", "encoder-decoder model of a family", "'t5'"]),
    "positions counted from the cache": (tf.TrOCRForCausalLM, lambda: tf.TrOCRConfig(
        vocab_size=64, d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64),
        ["'trocr'", "takes no position_ids"]),
}


@pytest.mark.parametrize("case", list(SERVED))
def test_served_kinds_pass(case):
    model_class, config = SERVED[case]
    check_supported(on_meta(model_class, config()))


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_kinds_are_refused_with_the_model_type_and_the_kind(case):
    model_class, config, fragments = REFUSED[case]
    model = on_meta(model_class, config())
    with pytest.raises(UnsupportedModel) as refused:
        check_supported(model)
    message = str(refused.value)
    assert message.startswith("Model type "), message
    for fragment in fragments:
        assert fragment in message, message
    assert "the server serves decoder-only causal LMs" in message


def test_unsupported_model_is_a_value_error():
    assert issubclass(UnsupportedModel, ValueError)


def test_the_engine_refuses_when_it_is_built():
    model = on_meta(tf.Qwen3NextForCausalLM, qwen3_next())
    with pytest.raises(UnsupportedModel, match="'linear_attention' layers"):
        Engine(model, None, CPU)


def test_layer_types_are_inferred_as_transformers_caches_do():
    assert layer_types(tf.LlamaConfig(**SMALL)) == ["full_attention"]
    assert layer_types(tf.MistralConfig(**SMALL, sliding_window=8)) == ["sliding_attention"]
    assert layer_types(tf.MistralConfig(**SMALL, sliding_window=None)) == ["full_attention"]
    assert set(layer_types(tf.Gemma2Config(**SMALL, head_dim=8))) == {"sliding_attention", "full_attention"}


def test_an_object_without_a_config_is_left_to_its_caller():
    check_supported(object())  # fakes and wrappers: nothing to check, nothing refused


@pytest.fixture(scope="module")
def hybrid_model_dir(tmp_path_factory, smollm2_tokenizer):
    """A real, saved tiny Qwen3-Next (linear-attention layers) with SmolLM2's tokenizer."""
    folder = tmp_path_factory.mktemp("qwen3-next-tiny")
    torch.manual_seed(0)
    tf.Qwen3NextForCausalLM(qwen3_next(len(smollm2_tokenizer))).save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("rolling_batch", ["disable", "auto"])
def test_a_model_the_engine_cannot_serve_fails_to_load_with_the_reason(hybrid_model_dir, rolling_batch, tmp_path):
    config = ModelConfig(name="hybrid", model_dir=str(hybrid_model_dir), task="text-generation",
                         rolling_batch=rolling_batch)
    service = ModelService(config, str(tmp_path))
    service.load()
    assert service.current_status() is ModelStatus.FAILED
    assert service.error.startswith("UnsupportedModel: Model type 'qwen3_next'"), service.error
    assert "'linear_attention' layers" in service.error
