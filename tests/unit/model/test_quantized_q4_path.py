"""Pre-quantized 4-bit checkpoints on the int4 kernels (option.quantize=q4): model/quantized/q4.py turns their
groups into Q4Blocks, convert.py writes them beside the dequantized weights (kernels/layers/q4_file.py), and
kernels/layers/quantize.py swaps them in as it does a GGUF's blocks.

Invariants: the blocks stand for exactly the weights the format's dequantizer gives; served through the int4
kernels, a checkpoint's logits equal its dequantized model's within the kernel's tolerance (fp32 activations:
summation order only; bf16: the activations' rounding), and its greedy continuations equal theirs in fp32;
GPTQ's activation order runs reordered; symmetric int8 checkpoints run on the block kernel in bf16 where their
scales are exact in fp16 (else on the VNNI kernel).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lmi_serve.kernels.layers.block_linears import BlockLinear, block_fits
from lmi_serve.kernels.layers.gguf_linears import Q4Linear, Q8Linear, ReorderedQ4Linear, q8_fits
from lmi_serve.kernels.layers.quantize import QuantizeError, quantize_model
from lmi_serve.kernels.layers.shared_input import SharedInputSlice
from lmi_serve.model.loader import four_bit_source, load_generation_model
from lmi_serve.model.quantized.blocks import kernel_blocks
from lmi_serve.model.quantized.weights import consecutive_groups, dequantize, quantize_int
from quantized_checkpoints import IDS, quantized_checkpoint

CPU = torch.device("cpu")


@pytest.mark.parametrize("group,desc_act", [(32, False), (128, False), (-1, False), (64, True)])
def test_q4_blocks_stand_for_the_dequantized_weight_exactly(group, desc_act):
    weight = torch.randn(48, 256, generator=torch.Generator().manual_seed(group))
    g_idx = None
    if desc_act:
        g_idx = consecutive_groups(256, group)[torch.randperm(256, generator=torch.Generator().manual_seed(1))]
    quantized = quantize_int(weight, 4, group, symmetric=False, g_idx=g_idx)
    blocks = kernel_blocks(quantized)
    assert torch.equal(blocks.dequantize(), dequantize(quantized))
    assert (blocks.columns is not None) == desc_act
    if desc_act:
        assert sorted(blocks.columns.tolist()) == list(range(256))


def test_weights_without_a_block_form_say_why():
    weight = torch.randn(32, 64)
    assert "3-bit" in kernel_blocks(quantize_int(weight, 3, 32, symmetric=True))
    assert "whole blocks of 32" in kernel_blocks(quantize_int(weight, 4, 16, symmetric=True))
    assert "not whole blocks" in kernel_blocks(quantize_int(torch.randn(32, 48), 4, 48, symmetric=True))


def _served(folder, cache, dtype):
    loaded = load_generation_model(str(folder), dtype=dtype, cache_dir=str(cache))
    return loaded


def _logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor(IDS)).logits.float()


def _greedy(model) -> list[list[int]]:
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor(IDS), max_new_tokens=12, do_sample=False, pad_token_id=0)
    return out[:, len(IDS[0]):].tolist()


# each unpacker once (AWQ, GPTQ with desc_act, compressed-tensors); groups wider than a block: the first test
@pytest.mark.parametrize("name", ["awq", "gptq-v1-desc_act", "ct-w4a16"])
def test_four_bit_checkpoint_runs_on_the_int4_kernels_as_its_dequantized_model(tmp_path, name):
    quantized_dir, reference_dir = quantized_checkpoint(tmp_path, name)
    cache = tmp_path / "cache"
    reference = _served(reference_dir, cache, "fp32").model
    loaded = _served(quantized_dir, cache, "fp32")
    source = four_bit_source(str(quantized_dir), None, loaded.source)
    assert source is not None and source.parent == Path(loaded.source)
    report = quantize_model(loaded.model, "q4", CPU, source)
    linears = [n for n, m in loaded.model.named_modules() if isinstance(m, Q4Linear)]
    assert len(report.swapped) == 14 and report.kept == {"lm_head": "not quantized in the checkpoint"}
    assert report.max_abs_diff <= 1e-6
    reordered = [m for m in loaded.model.modules() if isinstance(m, ReorderedQ4Linear)]
    if name == "gptq-v1-desc_act":  # a gather before the kernel; siblings stack only in one column order
        # (the fixture draws each layer's order from its row count: gate_proj's and up_proj's, 128, are the same;
        # q_proj's, 64, differs from k_proj's and v_proj's, 32, so q/k/v stay three layers)
        assert len(reordered) == 12
        assert sorted(report.stacked) == [f"model.layers.{i}.mlp.{p}_proj" for i in (0, 1) for p in ("gate", "up")]
    else:
        assert not reordered and len(report.stacked) == 10 and len(linears) == 8  # qkv, gate_up, o, down
        assert sum(isinstance(m, SharedInputSlice) for m in loaded.model.modules()) == 10
    expected = _logits(reference)
    assert torch.allclose(_logits(loaded.model), expected, rtol=0, atol=1e-4 * float(expected.abs().max()))
    assert _greedy(loaded.model) == _greedy(reference)


@pytest.mark.parametrize("name", ["gptq-v1-desc_act"])  # the reordered layers; the others are the same kernel
def test_four_bit_checkpoint_in_bf16_within_the_activations_rounding(tmp_path, name):
    quantized_dir, reference_dir = quantized_checkpoint(tmp_path, name)
    cache = tmp_path / "cache"
    reference = _logits(_served(reference_dir, cache, "fp32").model)
    loaded = _served(quantized_dir, cache, "bf16")
    quantize_model(loaded.model, "q4", CPU, four_bit_source(str(quantized_dir), None, loaded.source))
    logits = _logits(loaded.model)
    # bf16 activations and outputs: a few bf16 ulps of the largest logit through two layers
    assert float((logits - reference).abs().max()) <= 2.0**-5 * float(reference.abs().max())
    # a one-token step (the kernel's few rows, not the bf16 copy of prefill's many) within the same bound
    with torch.inference_mode():
        step = loaded.model(input_ids=torch.tensor(IDS)[:, :1]).logits.float()
    assert float((step - reference[:, :1]).abs().max()) <= 2.0**-5 * float(reference.abs().max())


@pytest.mark.parametrize("name", ["ct-w8a8", "gptq-v2-8bit"])
def test_symmetric_int8_checkpoint_runs_on_the_vnni_kernel_in_bf16(tmp_path, name):
    """W8A8 / 8-bit GPTQ: Q8 blocks on the VNNI kernel where it runs (bf16 activations); with fp32 activations
    the checkpoint has nothing for q4 to run, and says so."""
    quantized_dir, reference_dir = quantized_checkpoint(tmp_path, name)
    cache = tmp_path / "cache"
    fp32 = _served(quantized_dir, cache, "fp32")
    with pytest.raises(QuantizeError, match="holds no 4-bit weights"):
        quantize_model(fp32.model, "q4", CPU, four_bit_source(str(quantized_dir), None, fp32.source))
    reference = _logits(_served(reference_dir, cache, "fp32").model)
    loaded = _served(quantized_dir, cache, "bf16")
    source = four_bit_source(str(quantized_dir), None, loaded.source)
    if not q8_fits(64, torch.bfloat16):  # no AVX-512 VNNI here: every int8 layer kept, named
        with pytest.raises(QuantizeError, match="holds no 4-bit weights"):
            quantize_model(loaded.model, "q4", CPU, source)
        return
    report = quantize_model(loaded.model, "q4", CPU, source)
    # q/k/v and gate/up one int8 call each, as the int4 layers: 4 layers a decoder layer, on the block kernel
    # (as Q8_0 codes: the fixtures' bf16 / fp16 scales are exact in its fp16) where it runs, else the VNNI kernel
    assert len(report.swapped) == 14 and len(report.stacked) == 10
    on_blocks = block_fits(64, torch.bfloat16)
    assert sum(isinstance(m, BlockLinear) for m in loaded.model.modules()) == (8 if on_blocks else 0)
    assert sum(isinstance(m, Q8Linear) for m in loaded.model.modules()) == (0 if on_blocks else 8)
    with torch.inference_mode():  # one token a row: the VNNI kernel's few rows (more go to the bf16 copy)
        step = loaded.model(input_ids=torch.tensor(IDS)[:, :1]).logits.float()
    assert float((step - reference[:, :1]).abs().max()) <= 2.0**-5 * float(reference.abs().max())


def test_layers_without_blocks_are_kept_and_named(tmp_path):
    """An asymmetric 8-bit GPTQ layer has no Q8 form: the block file names why, and q4 refuses the checkpoint
    (nothing to run) rather than serve it as something else."""
    from lmi_serve.kernels.layers.block_file import read_block_file

    weight = torch.randn(32, 64)
    assert "asymmetric" in kernel_blocks(quantize_int(weight, 8, 32, symmetric=False))
    quantized_dir, _ = quantized_checkpoint(tmp_path, "awq")
    loaded = _served(quantized_dir, tmp_path / "cache", "fp32")
    layers, kept = read_block_file(four_bit_source(str(quantized_dir), None, loaded.source))
    assert len(layers) == 14 and kept == {}


def test_int8_scales_not_exact_in_fp16_stay_on_the_vnni_kernel():
    """The block kernel holds a block's scale in fp16: an int8 layer whose float32 scales fp16 would round runs on
    the VNNI kernel (fp32 scales), so the served weights stay the checkpoint's."""
    from lmi_serve.kernels.layers.gguf_linears import Q8Blocks
    from lmi_serve.kernels.layers.quantize import _on_block_kernel

    q = np.arange(-64, 64, dtype=np.int8).reshape(2, 64)
    exact = Q8Blocks(q, np.full((2, 2), 2.0**-9, np.float32))
    rounded = Q8Blocks(q, np.full((2, 2), 1 / 3000, np.float32))
    if not block_fits(64, torch.bfloat16):
        assert _on_block_kernel(exact, 64, torch.bfloat16) is exact
        return
    assert _on_block_kernel(exact, 64, torch.bfloat16).kind == "Q8_0"
    assert _on_block_kernel(rounded, 64, torch.bfloat16) is rounded
    assert _on_block_kernel(exact, 64, torch.float32) is exact


def test_a_gptq_lm_head_quantized_with_the_model_runs_on_the_int4_kernels(tmp_path):
    """GPTQModel's `lm_head: true` (vLLM reads it too): the lm_head's own GPTQ tensors, dequantized and as blocks
    like every other layer, so q4 runs it on the int4 kernels, within their tolerance of the dequantized model."""
    quantized_dir, reference_dir = quantized_checkpoint(tmp_path, "gptq-v1-g64+lm_head")
    cache = tmp_path / "cache"
    reference = _served(reference_dir, cache, "fp32").model
    loaded = _served(quantized_dir, cache, "fp32")
    report = quantize_model(loaded.model, "q4", CPU, four_bit_source(str(quantized_dir), None, loaded.source))
    assert "lm_head" in report.swapped and report.kept == {}
    assert isinstance(loaded.model.lm_head, Q4Linear)
    expected = _logits(reference)
    assert torch.allclose(_logits(loaded.model), expected, rtol=0, atol=1e-4 * float(expected.abs().max()))
    assert _greedy(loaded.model) == _greedy(reference)
