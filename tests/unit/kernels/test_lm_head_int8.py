"""option.quantize_lm_head: with option.quantize=q4, an lm_head the checkpoint leaves unquantized is rounded at load
to llama.cpp's Q8_0 (Q8Blocks.rounded: the gguf package's quantizer) and runs on the VNNI kernel.

Invariants: the rounding is Q8_0's (fp16 scales, each weight within half a step of its block's); a
checkpoint served with it has its lm_head on the int8 kernel and every other layer as without it, logits within
the int8 rounding of the lm_head; where the kernel cannot run the lm_head stays as loaded and the report says why;
the option without option.quantize=q4 is refused, naming it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmi_serve.config.sources import ConfigError, load_model_config
from lmi_serve.kernels.layers.gguf_linears import Q8Blocks, Q8Linear, q8_fits
from lmi_serve.kernels.layers.quantize import quantize_model
from lmi_serve.model.loader import four_bit_source, load_generation_model
from quantized_checkpoints import IDS, quantized_checkpoint

CPU = torch.device("cpu")


def test_rounding_is_q8_0_within_half_a_step_of_each_block():
    weight = torch.randn(40, 256, generator=torch.Generator().manual_seed(3)) * 0.05
    weight[3, 32:64] = 0  # an all-zero block: scale 0, codes 0
    weight[5, :32] = torch.linspace(-1, 1, 32)  # a block whose extremes map to -127 and 127 exactly
    ours = Q8Blocks.rounded(weight)
    assert ours.q.dtype == np.int8 and ours.q.shape == (40, 256) and ours.scale.shape == (40, 8)
    assert ours.q[5, 0] == -127 and ours.q[5, 31] == 127 and not ours.q[3, 32:64].any() and ours.scale[3, 1] == 0
    assert np.array_equal(ours.scale, ours.scale.astype(np.float16).astype(np.float32))  # fp16 scales
    # within half a step of each block's scale, plus the scale's fp16 rounding (half an ulp) times |q| <= 127
    step = torch.from_numpy(ours.scale).repeat_interleave(32, 1)
    assert bool(((ours.dequantize() - weight).abs() <= step * (0.5 + 127 * 2.0**-11)).all())


def _logits(model, ids) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor(ids)).logits.float()


def test_an_unquantized_lm_head_runs_on_the_int8_kernel_with_the_option(tmp_path):
    quantized_dir, _ = quantized_checkpoint(tmp_path, "awq")
    cache = str(tmp_path / "cache")
    plain = load_generation_model(str(quantized_dir), dtype="bf16", cache_dir=cache)
    source = four_bit_source(str(quantized_dir), None, plain.source)
    without = quantize_model(plain.model, "q4", CPU, source)
    loaded = load_generation_model(str(quantized_dir), dtype="bf16", cache_dir=cache)
    head_weight = loaded.model.get_output_embeddings().weight.detach().float().clone()
    report = quantize_model(loaded.model, "q4", CPU, source, lm_head_int8=True)
    if not q8_fits(64, torch.bfloat16):  # no AVX-512 VNNI here: kept as loaded, the report says why
        assert "option.quantize_lm_head" in report.kept["lm_head"] and not report.rounded
        return
    assert report.rounded == ["lm_head"] and "lm_head" not in report.kept and "lm_head rounded" in report.describe()
    assert isinstance(loaded.model.lm_head, Q8Linear)
    assert report.swapped == [*without.swapped, "lm_head"] and report.stacked == without.stacked
    # the tied input embedding keeps its bf16 weights
    assert torch.equal(loaded.model.get_input_embeddings().weight.float(), head_weight)
    # one token a row (the int8 kernel's few rows): the plain q4 model's logits moved by at most the lm_head's
    # rounding, |x| * half a step per weight, summed over the hidden size (plus bf16 rounding of the logits)
    first = [row[:1] for row in IDS]
    with torch.inference_mode():
        hidden = plain.model.model(input_ids=torch.tensor(first)).last_hidden_state.float()
    step = torch.from_numpy(Q8Blocks.rounded(head_weight).scale).repeat_interleave(32, 1)
    bound = (hidden.abs() @ (step * (0.5 + 127 * 2.0**-11)).T) + 2.0**-7 * _logits(plain.model, first).abs()
    moved = (_logits(loaded.model, first) - _logits(plain.model, first)).abs()
    assert bool((moved <= bound + 1e-3).all()) and float(moved.max()) > 0


def test_the_option_needs_option_quantize_q4():
    with pytest.raises(ConfigError, match=r"option\.quantize_lm_head.*needs option\.quantize=q4"):
        load_model_config(None, {"HF_MODEL_ID": "org/model", "OPTION_QUANTIZE_LM_HEAD": "true"})
    config = load_model_config(None, {"HF_MODEL_ID": "org/model", "OPTION_QUANTIZE_LM_HEAD": "true",
                                "OPTION_QUANTIZE": "q4", "OPTION_DTYPE": "bf16"})
    assert config.quantize_lm_head is True
