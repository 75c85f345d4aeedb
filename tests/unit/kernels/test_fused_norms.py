"""RMSNorm layers on F.rms_norm (kernels/layers/fused_norms.py).

- A Llama-formula RMSNorm is swapped and the model's logits stay bit for bit; its weight is the same
  Parameter (state_dict unchanged), and use_linear_kernel does the swap with either Linear kernel.
- A norm of another formula (Gemma's `1 + weight`) fails the probe and keeps its own forward.
- An input of another dtype than the weight takes the layer's own forward (only the weight's dtype was probed).
- A bf16 Llama norm takes the upcast form (fp32 norm, rounded, times the weight), bit for bit.
(Every architecture of the engine's matrix: tests/unit/engine/test_architectures.py.)
"""

from __future__ import annotations

import torch
from transformers import GemmaConfig, GemmaForCausalLM, LlamaConfig, LlamaForCausalLM

from lmi_serve.kernels.layers.fused_norms import FusedRMSNorm, use_fused_norms
from lmi_serve.kernels.layers.linear_kernels import use_linear_kernel

CPU = torch.device("cpu")
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, head_dim=16)


def with_norm_weights(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(1.0, 0.3)
    return model.eval()


def logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids).logits


IDS = torch.tensor([[5, 17, 99, 3, 250, 40, 7, 200], [9, 8, 7, 6, 5, 4, 3, 2]])


def test_a_llama_norm_is_swapped_and_keeps_the_bits():
    torch.manual_seed(0)
    model = with_norm_weights(LlamaForCausalLM(LlamaConfig(**SMALL)))
    keys = set(model.state_dict())
    before, one = logits(model, IDS), logits(model, IDS[:1, :1])
    swapped = use_fused_norms(model)
    assert len(swapped) == 2 * 2 + 1 and all(isinstance(model.get_submodule(n), FusedRMSNorm) for n in swapped)
    assert torch.equal(logits(model, IDS), before) and torch.equal(logits(model, IDS[:1, :1]), one)
    assert set(model.state_dict()) == keys


class PlainWeightRMSNorm(torch.nn.Module):
    """Llama's formula with its weight a plain tensor, not a Parameter (as some remote code keeps it)."""

    def __init__(self, weight: torch.Tensor, eps: float = 1e-6):
        super().__init__()
        self.weight, self.variance_epsilon = weight, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype)


def test_a_norm_whose_weight_is_a_plain_tensor_is_swapped_and_keeps_the_bits():
    model = torch.nn.Sequential(PlainWeightRMSNorm(torch.randn(64, generator=torch.Generator().manual_seed(1))))
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(2))
    before = model(x)
    assert use_fused_norms(model) == ["0"] and isinstance(model[0], FusedRMSNorm)
    assert torch.equal(model(x), before)


def test_the_linear_kernel_swap_brings_the_norms_with_either_kernel():
    for kernel in ("torch", "auto"):
        torch.manual_seed(0)
        model = with_norm_weights(LlamaForCausalLM(LlamaConfig(**SMALL)))
        report = use_linear_kernel(model, kernel, CPU)
        assert len(report.norms) == 5 and "5 RMSNorm layers on F.rms_norm" in report.describe()


def test_a_norm_of_another_formula_keeps_its_forward(caplog):
    caplog.set_level("INFO")
    torch.manual_seed(0)
    model = with_norm_weights(GemmaForCausalLM(GemmaConfig(**SMALL)))
    before = logits(model, IDS)
    assert use_fused_norms(model) == []
    assert torch.equal(logits(model, IDS), before)
    assert "kept their own forward (other bits): GemmaRMSNorm" in caplog.text


def test_an_input_of_another_dtype_takes_the_layers_own_forward():
    torch.manual_seed(0)
    model = with_norm_weights(LlamaForCausalLM(LlamaConfig(**SMALL)))
    norm = model.model.norm
    x = torch.randn(3, 64).to(torch.bfloat16)
    expected = norm(x)  # Llama's: computed in fp32, cast back, times the fp32 weight
    use_fused_norms(model)
    assert isinstance(model.model.norm, FusedRMSNorm)
    out = model.model.norm(x)
    assert out.dtype == expected.dtype and torch.equal(out, expected)


def test_a_bf16_llama_norm_takes_the_upcast_form_and_keeps_the_bits():
    """In bf16 the layer rounds before its weight multiplies: `F.rms_norm` with the weight is not its
    bits, the upcast form (fp32 norm, rounded, times the weight) is, and the probe picks that one."""
    torch.manual_seed(0)
    model = with_norm_weights(LlamaForCausalLM(LlamaConfig(**SMALL))).to(torch.bfloat16)
    norm = model.model.norm
    x = torch.randn(4, 5, 64).mul(3).to(torch.bfloat16)
    with torch.no_grad():
        assert not torch.equal(FusedRMSNorm(norm, norm.variance_epsilon, "direct")(x), norm(x))
    before, one = logits(model, IDS), logits(model, IDS[:1, :1])
    swapped = use_fused_norms(model)
    assert len(swapped) == 5 and {model.get_submodule(n).form for n in swapped} == {"upcast"}
    assert torch.equal(logits(model, IDS), before) and torch.equal(logits(model, IDS[:1, :1]), one)
