"""Decoder layers of the Llama family in fewer ops (kernels/layers/lean_layers.py): the same bits as transformers'.

- Llama, Qwen2 and Qwen3 (per-head q/k norms) with sdpa and eager attention: a padded prefill and decode
  steps over transformers' DynamicCache give the logits of the layers' own forward, bit for bit, with plain
  Linear layers and with q/k/v and gate/up stacked on oneDNN (then q and k rotate in one call).
- The rotary's roll form equals transformers' rotate_half form bit for bit.
- Families outside LEAN_LAYERS and training mode keep transformers' forward; use_linear_kernel makes
  layers lean on the CPU unless told not to.
(The engine's architecture matrix holds lean layers to generate(): tests/unit/engine/test_architectures.py.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (DynamicCache, GemmaConfig, GemmaForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from lmi_serve.kernels.cpu import rotary_kernel
from lmi_serve.kernels.layers import lean_layers
from lmi_serve.kernels.layers.lean_layers import SignedSin, rotate_heads, use_lean_layers
from lmi_serve.kernels.host import onednn_available
from lmi_serve.kernels.layers.linear_kernels import use_linear_kernel

CPU = torch.device("cpu")
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, head_dim=16)
FAMILIES = {"llama": (LlamaForCausalLM, LlamaConfig), "qwen2": (Qwen2ForCausalLM, Qwen2Config),
            "qwen3": (Qwen3ForCausalLM, Qwen3Config)}
IDS = torch.tensor([[5, 17, 99, 3, 250, 40, 7, 200], [0, 0, 0, 6, 5, 4, 3, 2]])
MASK = torch.tensor([[1] * 8, [0, 0, 0, 1, 1, 1, 1, 1]])


def build(family: str, attention: str) -> torch.nn.Module:
    model_class, config_class = FAMILIES[family]
    torch.manual_seed(0)
    config = config_class(**SMALL)
    config._attn_implementation = attention
    model = model_class(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(1.0, 0.3)
            elif "bias" in name:
                parameter.normal_(0.0, 0.3)
    return model


def run(model, steps: int = 3, ids: torch.Tensor = IDS, mask: torch.Tensor = MASK) -> list[torch.Tensor]:
    """A padded prefill of `ids` (left padding where `mask` is 0) and `steps` greedy decode steps: every step's
    logits."""
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
        logits = [out.logits]
        for _ in range(steps):
            ids = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(ids)], dim=-1)
            positions = positions[:, -1:] + 1
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
            logits.append(out.logits)
    return logits


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_lean_layers_give_the_layers_own_bits(family, attention):
    model = build(family, attention)
    expected = run(model)
    assert len(use_lean_layers(model)) == SMALL["num_hidden_layers"]
    assert all(torch.equal(a, b) for a, b in zip(run(model), expected, strict=True))


@pytest.mark.skipif(not onednn_available(), reason="torch without oneDNN")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_stacked_projections_on_onednn_keep_the_bits_and_rotate_q_and_k_together(family, monkeypatch):
    model = build(family, "sdpa")
    use_linear_kernel(model, "onednn", CPU, lean=False, row_kernel="off")  # the row kernel's chain rotates itself
    expected = run(model, steps=2)
    calls = []  # rotations: the numba kernel's (None where it does not apply) or torch's ops
    monkeypatch.setattr(lean_layers, "rotate_heads", lambda *args: calls.append(1) or rotate_heads(*args))
    kernel = rotary_kernel.rotate

    def counted(*args):
        out = kernel(*args)
        if out is not None:
            calls.append(1)
        return out

    monkeypatch.setattr(rotary_kernel, "rotate", counted)
    assert len(use_lean_layers(model)) == SMALL["num_hidden_layers"]
    assert all(torch.equal(a, b) for a, b in zip(run(model, steps=2), expected, strict=True))
    per_forward = len(calls) // 3 // SMALL["num_hidden_layers"]  # a prefill and two decode steps
    assert per_forward == (2 if family == "qwen3" else 1), "q and k rotate together unless per-head norms part them"


def test_the_roll_form_of_rotary_is_transformers_bit_for_bit():
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 9, 7, 64, generator=generator), torch.randn(3, 3, 7, 64, generator=generator)
    cos, sin = torch.randn(3, 7, 64, generator=generator), torch.randn(3, 7, 64, generator=generator)
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin)
    signed = SignedSin()
    cos_heads, sin_heads = signed.terms(cos, sin)
    assert torch.equal(rotate_heads(q, cos_heads, sin_heads), expected_q)
    assert torch.equal(rotate_heads(k, cos_heads, sin_heads), expected_k)
    again = signed.terms(cos, sin)
    assert again[0] is cos_heads and again[1] is sin_heads, "made once per forward's cos and sin"
    assert signed.terms(cos.clone(), sin)[0] is not cos_heads, "another forward's cos is not this one's"


def test_other_families_remote_code_and_training_keep_their_forward():
    torch.manual_seed(0)
    gemma = GemmaForCausalLM(GemmaConfig(**SMALL)).eval()
    assert use_lean_layers(gemma) == []
    model = build("llama", "sdpa")
    model.train()
    assert use_lean_layers(model) == []
    model = build("llama", "sdpa")
    # remote code that names its classes as transformers does (its own module): not ours to inline
    remote = type("LlamaDecoderLayer", (type(model.model.layers[0]),), {"__module__": "transformers_modules.x"})
    for layer in model.model.layers:
        layer.__class__ = remote
    assert use_lean_layers(model) == []


def test_use_linear_kernel_makes_layers_lean_on_the_cpu_unless_told_not_to():
    for kernel in ("torch", "auto"):
        model = build("llama", "sdpa")
        twin = copy.deepcopy(model)
        report = use_linear_kernel(model, kernel, CPU)
        assert len(report.lean) == 2 and "2 lean decoder layers" in report.describe()
        assert "forward" in vars(model.model.layers[0])
        assert use_linear_kernel(twin, kernel, CPU, lean=False).lean == []
        assert "forward" not in vars(twin.model.layers[0])


def test_q_and_k_join_only_as_views_of_one_buffer():
    stacked = torch.randn(2, 3, 10)
    q, k = stacked[..., :4], stacked[..., 4:6]
    assert lean_layers._adjacent(q, k) and torch.equal(lean_layers._joined(q, k), stacked[..., :6])
    assert not lean_layers._adjacent(q, stacked[..., 5:7])  # a gap between them
    assert not lean_layers._adjacent(q.clone(), k.clone())  # two buffers, wherever they lie
