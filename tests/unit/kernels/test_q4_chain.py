"""A q4-bf16 decoder layer's few rows in three numba calls (kernels/cpu/q4_chain.py): the unchained layers' bits.

- A tiny Llama on a GGUF's Q4 blocks with bf16 activations, swapped as the server swaps it (q4 quantize,
  stacked siblings, fused norms, lean layers): a padded prefill and decode steps of one to eight rows give
  the logits of the same model with no chain, bit for bit, and the chain ran every decode layer (the
  prefill's 9+ rows took the usual path).
- A layer keeps the usual path where a piece is not on the Q4 kernel, and for more rows or fp32 rows.
"""

from __future__ import annotations

import pytest
import torch

from lmi_serve.kernels.cpu import q4_chain, q4_kernel
from lmi_serve.kernels.host import cpu_has
from lmi_serve.kernels.registry import KERNELS
from lmi_serve.kernels.layers.linear_kernels import packable_dtypes, use_linear_kernel
from lmi_serve.kernels.host import omp_layer_loads
from lmi_serve.kernels.layers.chains import Q4LayerChain
from lmi_serve.kernels.layers.quantize import quantize_model

from test_lean_layers import run
from test_quantize import CPU, tiny_llama, write_q4_gguf

pytestmark = pytest.mark.skipif(not (cpu_has(*KERNELS["q4"].cpu_features) and omp_layer_loads()) or torch.bfloat16 not in packable_dtypes(),
                                reason="no AVX-512 BF16 (or numba's OpenMP layer) here")
LAYERS = 2


def swapped(tmp_path) -> torch.nn.Module:
    model = tiny_llama(tied=False)
    with torch.no_grad():  # norm weights other than ones, as a trained model's (ones agree with another form too)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    write_q4_gguf(model, tmp_path / "tiny.gguf")
    model = model.to(torch.bfloat16)
    quantize_model(model, "q4", CPU, tmp_path / "tiny.gguf")
    use_linear_kernel(model, "auto", CPU)  # fused norms and lean layers (the Q4 layers are not nn.Linear)
    return model


def decode(model, rows: int, steps: int = 3) -> list[torch.Tensor]:
    """A prefill of `rows` prompts of different lengths (left-padded) and `steps` greedy decode steps."""
    generator = torch.Generator().manual_seed(rows)
    lengths = [9 - row % 4 for row in range(rows)]
    ids = torch.randint(3, 500, (rows, max(lengths)), generator=generator)
    mask = torch.tensor([[0] * (max(lengths) - n) + [1] * n for n in lengths])
    return run(model, steps, ids, mask)


def counting(monkeypatch) -> list[int]:
    calls = []
    attention_in = Q4LayerChain.attention_in
    monkeypatch.setattr(Q4LayerChain, "attention_in",
                        lambda self, x, *args: calls.append(x.shape[0]) or attention_in(self, x, *args))
    return calls


def test_it_compiles_where_the_q4_kernel_runs():
    assert q4_chain._compiled.get() is not None


@pytest.mark.parametrize("rows", [1, 3, q4_chain.MAX_ROWS])
def test_chained_layers_give_the_unchained_bits(rows, tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(Q4LayerChain, "of", classmethod(lambda cls, *modules: None))
        expected = decode(swapped(tmp_path), rows)
    calls = counting(monkeypatch)
    got = decode(swapped(tmp_path), rows)
    assert got[-1].dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert calls == [rows] * ((len(got) - 1) * LAYERS), "every decode layer chained; the 9+ row prefill not"


def test_a_layer_off_the_q4_kernel_keeps_the_usual_path(tmp_path, monkeypatch):
    model = swapped(tmp_path)
    layer = model.model.layers[1]
    plain = torch.nn.Linear(layer.mlp.down_proj.in_features, layer.mlp.down_proj.out_features, bias=False)
    layer.mlp.down_proj = plain.to(torch.bfloat16)  # as a LoRA wrapper would replace it
    calls = counting(monkeypatch)
    decode(model, 1, steps=1)
    assert len(calls) == LAYERS - 1


def test_more_rows_or_fp32_rows_take_the_usual_path(tmp_path):
    layer = swapped(tmp_path).model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    chain = Q4LayerChain.of(layer.input_layernorm, (attn.q_proj, attn.k_proj, attn.v_proj), attn.o_proj,
                            layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj), mlp.down_proj)
    width = layer.input_layernorm.weight.shape[0]
    assert chain.takes(torch.zeros(q4_chain.MAX_ROWS, 1, width, dtype=torch.bfloat16))
    assert not chain.takes(torch.zeros(q4_chain.MAX_ROWS + 1, 1, width, dtype=torch.bfloat16))
    assert not chain.takes(torch.zeros(1, 1, width))
    assert not chain.takes(torch.zeros(1, 2 * width, dtype=torch.bfloat16)[:, ::2])  # not contiguous
