"""Sibling layers of one input stacked into one oneDNN matmul (kernels/layers/shared_input.py).

- A stacked member answers what its own OneDnnLinear answers, bit for bit (1, 2 and 32 rows, 3-D
  inputs, with and without bias), so every greedy reference and batch invariance hold unchanged.
- use_linear_kernel stacks q/k/v and gate/up of a decoder model and leaves the model's logits
  bit for bit those of the unstacked oneDNN model; encoder-decoder models and cross-attention modules
  are not stacked.
- A member is never handed a result for another input: another tensor, the same one changed in place, a
  member asking twice, or another thread each get a fresh computation; nothing is kept once every
  member has its slice.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from transformers import BartConfig, BartForConditionalGeneration, LlamaConfig, LlamaForCausalLM

from lmi_serve.kernels.host import onednn_available
from lmi_serve.kernels.layers.linear_kernels import OneDnnLinear, packable_dtypes, use_linear_kernel
from lmi_serve.kernels.layers.shared_input import SharedInputSlice, stack_shared_inputs

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch was built without oneDNN")
CPU = torch.device("cpu")


class Attention(torch.nn.Module):
    def __init__(self, hidden: int, kv: int, bias: bool):
        super().__init__()
        self.q_proj = torch.nn.Linear(hidden, hidden, bias=bias)
        self.k_proj = torch.nn.Linear(hidden, kv, bias=bias)
        self.v_proj = torch.nn.Linear(hidden, kv, bias=bias)


def stacked_and_alone(hidden=576, kv=192, bias=False):
    """An attention's three layers stacked, and each layer alone on its own OneDnnLinear."""
    torch.manual_seed(0)
    module = Attention(hidden, kv, bias)
    alone = {name: OneDnnLinear(getattr(module, name)) for name in ("q_proj", "k_proj", "v_proj")}
    stacked = stack_shared_inputs(module, packable_dtypes(), OneDnnLinear)
    assert stacked == ["q_proj", "k_proj", "v_proj"]
    return module, alone


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 576), (2, 576), (32, 576), (3, 5, 576), (1, 1, 576)])
def test_a_stacked_member_answers_its_own_layer_bit_for_bit(bias, shape):
    module, alone = stacked_and_alone(bias=bias)
    x = torch.randn(*shape)
    with torch.no_grad():
        for name, layer in alone.items():
            out = getattr(module, name)(x)
            assert isinstance(getattr(module, name), SharedInputSlice)
            assert out.is_contiguous() and out.shape == (*shape[:-1], layer.out_features)
            assert torch.equal(out, layer(x)), name


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config).eval()


def test_a_decoder_is_stacked_and_keeps_its_logits_bit_for_bit():
    model = tiny_llama()
    unstacked = copy.deepcopy(model)
    assert not use_linear_kernel(unstacked, "onednn", CPU, stack_siblings=False).stacked
    report = use_linear_kernel(model, "onednn", CPU)
    per_layer = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
    assert sorted(report.stacked) == sorted(f"model.layers.{i}.{name}" for i in range(2) for name in per_layer)
    assert len(report.swapped) == 2 * 7 + 1  # stacked or alone, every Linear is on oneDNN
    assert "10 of them stacked" in report.describe()
    ids = torch.tensor([[5, 17, 99, 3, 250, 40, 7, 300], [9, 8, 7, 6, 5, 4, 3, 2]])
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, unstacked(input_ids=ids).logits)
        assert torch.equal(model(input_ids=ids[:1, :1]).logits, unstacked(input_ids=ids[:1, :1]).logits)


def test_encoder_decoder_models_and_cross_attention_are_not_stacked():
    config = BartConfig(vocab_size=128, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64)
    assert not use_linear_kernel(BartForConditionalGeneration(config).eval(), "onednn", CPU).stacked

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn, self.cross_attn = Attention(64, 32, False), Attention(64, 32, False)

    assert stack_shared_inputs(Layer(), packable_dtypes(), OneDnnLinear) == [
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]


def counted(module):
    """The number of stacked matmuls `module`'s group runs, as a list that grows."""
    group = module.q_proj._group
    runs, kernel = [], group.linear
    group.linear = lambda x: runs.append(x.shape) or kernel(x)
    return runs


def test_a_member_is_never_handed_the_result_for_another_input():
    module, alone = stacked_and_alone(hidden=64, kv=32)
    runs = counted(module)
    x, y = torch.randn(2, 64), torch.randn(2, 64)
    with torch.no_grad():
        assert torch.equal(module.q_proj(x), alone["q_proj"](x))
        assert torch.equal(module.k_proj(y), alone["k_proj"](y))  # another input: computed for it
        assert len(runs) == 2
        assert torch.equal(module.v_proj(y), alone["v_proj"](y)) and len(runs) == 2  # y's result, shared
        assert torch.equal(module.q_proj(x), alone["q_proj"](x))
        x.mul_(2)  # changed in place after q took its slice
        assert torch.equal(module.k_proj(x), alone["k_proj"](x)) and len(runs) == 4
        assert torch.equal(module.k_proj(x), alone["k_proj"](x)) and len(runs) == 5  # k asking twice
        assert module.q_proj._group._kept.value is not None


def test_one_result_serves_the_siblings_and_is_let_go():
    module, _ = stacked_and_alone(hidden=64, kv=32)
    runs = counted(module)
    x = torch.randn(3, 64)
    with torch.no_grad():
        module.q_proj(x), module.k_proj(x), module.v_proj(x)
    assert len(runs) == 1
    assert module.q_proj._group._kept.value is None  # all three took theirs: nothing held between forwards


def test_each_thread_keeps_its_own_result():
    module, alone = stacked_and_alone(hidden=64, kv=32)
    x, y = torch.randn(2, 64), torch.randn(2, 64)
    seen = {}
    with torch.no_grad():
        module.q_proj(x)  # this thread keeps x's result

        def other():
            with torch.no_grad():
                module.q_proj(y)
                seen["k"] = module.k_proj(y)

        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
        assert torch.equal(seen["k"], alone["k_proj"](y))
        assert torch.equal(module.k_proj(x), alone["k_proj"](x))  # x's result, not the other thread's
