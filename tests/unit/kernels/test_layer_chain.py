"""A decoder layer's few-row fp32 path in three numba calls (kernels/cpu/layer_chain.py): the unchained layers' bits.

- Llama and Qwen2 (biased q/k/v) and Qwen3 (per-head q/k norms), swapped as the server swaps them (oneDNN,
  stacked siblings, the row kernel, fused norms, lean layers): a padded prefill and decode steps of one to
  eight rows give the logits of the same model with no chain, bit for bit, and the chain ran every decode
  layer (the prefill's 9+ rows took the usual path), rotating q and k inside its first call (not Qwen3's).
- A layer keeps the usual path where a piece is not on our kernels (no row kernel copy, a norm on
  F.rms_norm, a module swapped after the first call) and for more than MAX_ROWS rows or another dtype.
"""

from __future__ import annotations

import pytest
import torch

from lmi_serve.kernels.cpu import layer_chain, rotary_kernel, row_kernel
from lmi_serve.kernels.layers.chains import LayerChain
from lmi_serve.kernels.host import onednn_available
from lmi_serve.kernels.layers.linear_kernels import use_linear_kernel

from test_lean_layers import FAMILIES, SMALL, build, run

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not onednn_available() or layer_chain.kernel() is None,
                                reason="this torch has no oneDNN, or numba's OpenMP layer is missing")


def decode(model, rows: int, steps: int = 3) -> list[torch.Tensor]:
    """A prefill of `rows` prompts of different lengths (left-padded) and `steps` greedy decode steps."""
    generator = torch.Generator().manual_seed(rows)
    lengths = [9 - row % 4 for row in range(rows)]
    ids = torch.randint(3, SMALL["vocab_size"], (rows, max(lengths)), generator=generator)
    mask = torch.tensor([[0] * (max(lengths) - n) + [1] * n for n in lengths])
    return run(model, steps, ids, mask)


def swapped(family: str) -> torch.nn.Module:
    model = build(family, "sdpa")
    report = use_linear_kernel(model, "onednn", CPU, row_kernel="on")
    assert report.row_kernel.layers == 4 * SMALL["num_hidden_layers"] + 1  # q/k/v, o, gate/up, down; lm_head
    return model


def unchained(monkeypatch) -> None:
    monkeypatch.setattr(LayerChain, "of", classmethod(lambda cls, *modules: None))


def counting(monkeypatch) -> list[int]:
    calls = []
    attention_in = LayerChain.attention_in
    monkeypatch.setattr(LayerChain, "attention_in",
                        lambda self, x, *args: calls.append(x.shape[0]) or attention_in(self, x, *args))
    return calls


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("rows", [1, 3, layer_chain.MAX_ROWS])
def test_chained_layers_give_the_unchained_bits(family, rows, monkeypatch):
    with monkeypatch.context() as patch:
        unchained(patch)
        expected = decode(swapped(family), rows)
    calls = counting(monkeypatch)
    rotations = []  # rotary_kernel.rotate's, outside the chain
    rotate = rotary_kernel.rotate
    monkeypatch.setattr(rotary_kernel, "rotate", lambda *args: rotations.append(1) or rotate(*args))
    got = decode(swapped(family), rows)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    steps = len(got) - 1
    prefill_rows = rows * 9  # more than MAX_ROWS rows: the prefill takes the usual path
    assert prefill_rows > layer_chain.MAX_ROWS
    assert calls == [rows] * (steps * SMALL["num_hidden_layers"])
    # the chain rotates q and k inside its first call; Qwen3's per-head norms come between: torch's ops there
    assert len(rotations) == (0 if family == "qwen3" else SMALL["num_hidden_layers"])  # the prefill's


def test_a_layer_off_our_kernels_keeps_the_usual_path(monkeypatch):
    model = build("llama", "sdpa")
    use_linear_kernel(model, "onednn", CPU, row_kernel="off")  # no row-kernel copies
    calls = counting(monkeypatch)
    decode(model, 2)
    assert calls == []
    layer = swapped("llama").model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    pieces = dict(input_norm=layer.input_layernorm, qkv=(attn.q_proj, attn.k_proj, attn.v_proj), o=attn.o_proj,
                  post_norm=layer.post_attention_layernorm, gate_up=(mlp.gate_proj, mlp.up_proj), down=mlp.down_proj)
    assert LayerChain.of(**pieces) is not None
    layer.post_attention_layernorm.kernel = False  # F.rms_norm's path: not the norm kernel's arithmetic
    assert LayerChain.of(**pieces) is None
    layer.post_attention_layernorm.kernel = True
    assert LayerChain.of(**{**pieces, "qkv": pieces["qkv"][::-1]}) is None  # not the stacked layer's order
    attn.o_proj.register_forward_hook(lambda *args: None)  # a hook must fire: the module is called
    assert LayerChain.of(**pieces) is None


def test_a_module_swapped_after_the_first_call_is_a_new_chain_or_none(monkeypatch):
    model = swapped("llama")
    calls = counting(monkeypatch)
    decode(model, 1, steps=1)
    assert len(calls) == SMALL["num_hidden_layers"]
    layer = model.model.layers[0]
    plain = torch.nn.Linear(SMALL["intermediate_size"], SMALL["hidden_size"], bias=False)
    plain.weight.data.copy_(layer.mlp.down_proj.dense_weight())
    layer.mlp.down_proj = plain  # as a LoRA wrapper would replace it
    calls.clear()
    decode(model, 1, steps=1)
    assert len(calls) == SMALL["num_hidden_layers"] - 1


def test_more_rows_or_another_dtype_take_the_usual_path():
    layer = swapped("llama").model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    chain = LayerChain.of(layer.input_layernorm, (attn.q_proj, attn.k_proj, attn.v_proj), attn.o_proj,
                          layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj), mlp.down_proj)
    width = SMALL["hidden_size"]
    assert chain.takes(torch.zeros(layer_chain.MAX_ROWS, 1, width))
    assert not chain.takes(torch.zeros(layer_chain.MAX_ROWS + 1, 1, width))
    assert not chain.takes(torch.zeros(1, 1, width, dtype=torch.bfloat16))
    assert not chain.takes(torch.zeros(1, 2 * width)[:, ::2])  # not contiguous
