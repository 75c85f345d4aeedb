"""A Q4_K_M file as llama-quantize writes one for a model of widths that are not multiples of 256 (SmolLM2-135M's),
swapped by option.quantize=q4 with bf16 activations (kernels/layers/quantize.py, block_linears.py):

- every layer runs its own blocks: Q5_0 and Q6_K on the block kernel, Q4_K on the Q4 kernel, a q/k/v of Q5_0
  and Q8_0 as one stacked layer of parts; nothing keeps its loaded weights, and the start-up report says which
  kernel runs what;
- its one-row logits are as close to fp32's (the dequantized GGUF) as the bf16 model's;
- its decoder layers run as the q4 layer chain (kernels/cpu/q4_chain.py) with the unchained layers' bits.
"""

from __future__ import annotations

import gguf
import pytest
import torch

from lmi_serve.kernels.host import cpu_has, omp_layer_loads
from lmi_serve.kernels.layers.block_linears import BlockLinear
from lmi_serve.kernels.layers.chains import Q4LayerChain
from lmi_serve.kernels.layers.gguf_linears import Q4Linear
from lmi_serve.kernels.layers.linear_kernels import packable_dtypes, use_linear_kernel
from lmi_serve.kernels.layers.quantize import quantize_model
from lmi_serve.kernels.registry import KERNELS

from test_lean_layers import run
from test_quantize import CPU, IDS, logits, tiny_llama_256, write_q4_gguf

pytestmark = pytest.mark.skipif(not (cpu_has(*KERNELS["block_bf16"].cpu_features) and omp_layer_loads()),
                                reason="no AVX-512 BF16 (or numba's OpenMP layer) here")
T = gguf.GGMLQuantizationType
# SmolLM2's Q4_K_M: Q5_0 where a width is not a multiple of 256 (here: all but down_proj, whose 256 is), attn_v
# Q8_0 in some layers, ffn_down Q4_K or Q6_K, output Q6_K
MIX = {"qtype": T.Q5_0, "types": {"model.layers.0.self_attn.v_proj": T.Q8_0, "model.layers.0.mlp.down_proj": T.Q4_K,
                                  "model.layers.1.mlp.down_proj": T.Q6_K, "lm_head": T.Q6_K}}


def swapped_mix(tmp_path) -> tuple[torch.nn.Module, object, torch.Tensor, torch.Tensor]:
    """The mix's model swapped in bf16, its report, and fp32's and the bf16 model's one-row logits."""
    model = tiny_llama_256()
    with torch.no_grad():  # norm weights other than ones, as a trained model's (test_q4_chain.py says why)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    write_q4_gguf(model, tmp_path / "mix.gguf", **MIX)
    one = [IDS[0][:1]]
    fp32 = logits(model, one)
    model = model.to(torch.bfloat16)
    bf16 = logits(model, one).float()
    return model, quantize_model(model, "q4", CPU, tmp_path / "mix.gguf"), fp32, bf16


def test_every_layer_runs_its_own_blocks_and_the_report_says_where(tmp_path):
    model, report, fp32, bf16 = swapped_mix(tmp_path)
    assert not report.kept and len(report.swapped) == 2 * 7 + 1
    first, second = model.model.layers
    assert first.self_attn.q_proj.stacked.kernel_weights.formats == ["Q5_0", "Q8_0"]
    assert second.self_attn.q_proj.stacked.kernel_weights.formats == ["Q5_0"]
    assert type(first.mlp.down_proj) is Q4Linear and first.mlp.down_proj.kernel_weights is not None
    assert [m.kernel_weights.formats for m in (second.mlp.down_proj, model.lm_head)] == [["Q6_K"], ["Q6_K"]]
    assert isinstance(first.mlp.gate_proj.stacked, BlockLinear) and isinstance(first.self_attn.o_proj, BlockLinear)
    assert report.kernels == {"block kernel (Q5_0 + Q8_0)": 1, "block kernel (Q5_0)": 5, "Q4 kernel": 1,
                              "block kernel (Q6_K)": 2}
    assert "a few rows on: block kernel (Q5_0 + Q8_0) 1, " in report.describe()
    got = logits(model, [IDS[0][:1]]).float()
    assert 0 < (got - fp32).abs().max() < 1.5 * (bf16 - fp32).abs().max(), ((got - fp32).abs().max(),
                                                                         (bf16 - fp32).abs().max())


@pytest.mark.skipif(torch.bfloat16 not in packable_dtypes(), reason="the CPU only emulates bf16")
def test_the_mix_runs_as_the_layer_chain_with_the_unchained_bits(tmp_path, monkeypatch):
    def decoded(chained: bool) -> list[torch.Tensor]:
        model = swapped_mix(tmp_path)[0]
        with monkeypatch.context() as patch:
            if not chained:
                patch.setattr(Q4LayerChain, "of", classmethod(lambda cls, *modules: None))
            use_linear_kernel(model, "auto", CPU)
        ids = torch.randint(3, 500, (5, 6), generator=torch.Generator().manual_seed(5))  # 5 rows: 4 + 1
        return run(model, 2, ids, torch.ones_like(ids))

    calls = []
    attention_in = Q4LayerChain.attention_in
    expected = decoded(chained=False)
    monkeypatch.setattr(Q4LayerChain, "attention_in",
                        lambda self, x, *args: calls.append(x.shape[0]) or attention_in(self, x, *args))
    got = decoded(chained=True)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert calls == [5] * ((len(got) - 1) * 2), "every decode layer chained"
