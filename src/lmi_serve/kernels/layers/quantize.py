"""Opt-in lighter weights (`option.quantize`): swap a loaded model's `nn.Linear` modules in place.

Pure model surgery: no engine, no HTTP. The model stays a transformers model; only its Linear
modules are replaced, so every KV implementation and both batching modes work unchanged.

- ``fp16``: weights stored in fp16, compute in fp32 (fbgemm's ``linear_prepack_fp16`` /
  ``linear_dynamic_fp16``), on every Linear including lm_head. The output equals fp32 ``F.linear``
  with the weights rounded to fp16. A tied lm_head gets its own fp16 copy: the input embedding
  keeps its fp32 weight.
- ``q4``: the checkpoint's own quantized blocks, lossless relative to them: a GGUF's Q4_0 / Q4_1 / Q4_K as
  group-32 int4, w = (q - 8) scale + zero (Q4_1: scale = d, zero = m + 8d; Q4_0: zero = 0; Q4_K, per 32-weight
  sub-block j: scale = d sc_j, zero = 8 scale - dmin m_j, in fp32), or a pre-quantized checkpoint's AWQ / GPTQ /
  compressed-tensors groups (their block file, kernels/layers/block_file.py, written at load by
  model/quantized/convert.py: w = (code - z) s = (q - 8) s + (8 - z) s; symmetric int8 layers as Q8_0-like
  blocks). Activations keep the model's dtype: fp32 (exact, but torch's int4 kernel runs a scalar loop there) or
  bf16 (option.dtype=bf16: the fast path). With bf16 on a CPU with AVX-512 BF16, Q4 layers run on
  kernels/cpu/q4_kernel.py, and a GGUF's Q5_0 (llama-quantize's fallback for Q4_K where a width is not a
  multiple of 256: most of SmolLM2's Q4_K_M), Q6_K and Q8_0 blocks on kernels/cpu/block_matmul.py
  (kernels/layers/block_linears.py), siblings of different formats as one stacked layer of parts; elsewhere
  Q4 on torch's int4 kernel (bf16 scales) and Q5_0 as int8 on the VNNI kernel (kernels/cpu/vnni_matmul.py,
  AVX-512 VNNI), where a lone Q8_0 layer (SmolLM2's tied lm_head) runs in any case. Other types (Q5_K, ...)
  keep their loaded weights, named in the report. More than a few rows go to a bf16 oneDNN copy of the loaded
  weights (the kernels compute row by row). Each packed layer is checked against the loaded weight (the
  dequantized GGUF, rounded to the model's dtype) before it replaces it. The few-row kernels compute each
  row on its own: a row's output does not depend on the others in the batch (the bf16 copy's does).

Both run on CPU only (the kernels are CPU kernels).
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lmi_serve.kernels.layers.block_linears import (BlockLinear, CodeBlocks, block_fits, codes_of, merged,
                                                    unpack_q6_k_blocks)
from lmi_serve.kernels.layers.gguf_linears import (FewRowsLinear, Q4Blocks, Q8Blocks, Q8Linear, q4_linear, q8_fits,
                                                   unpack_q4_blocks, unpack_q8_blocks)
from lmi_serve.kernels.layers.block_file import NAME as BLOCK_FILE
from lmi_serve.kernels.layers.block_file import read_block_file
from lmi_serve.kernels.layers.fp16_linear import Fp16Linear
from lmi_serve.kernels.layers.linear_kernels import OneDnnLinear, packable_dtypes
from lmi_serve.kernels.layers.shared_input import concatenated_linear, stack_groups
from lmi_serve.kernels.layers.gguf_tensors import GgufLinears, permute_rows, read_gguf_linears
from lmi_serve.kernels.layers.surgery import (own_remaining_tensors, plain_linears, process_rss, replace_module,
                                             return_freed_memory)

log = logging.getLogger(__name__)

MODES = ("none", "fp16", "q4")
_Q4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
# Q5_0 / Q6_K on the bf16 block kernel where it runs (Q5_0 else as int8 on the VNNI kernel: its codes minus 16
# are int8, exactly); Q8_0 on the VNNI kernel, or on the block kernel stacked with siblings of other formats
_WIDER_TYPES = ("Q5_0", "Q6_K", "Q8_0")
# max |packed - loaded| relative to the layer's largest weight: the loaded dtype's rounding only
_MATCH_TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 2.0**-8}
Q4_ACTIVATIONS = tuple(_MATCH_TOLERANCE)  # the dtypes a q4 layer computes in (the model's)


class QuantizeError(ValueError):
    """`option.quantize` cannot apply to this model; the message says why and what to do."""


@dataclass
class QuantizeReport:
    """What a swap did: for the start-up log and the benchmarks."""

    mode: str
    swapped: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # Linear module -> why it keeps fp32 weights
    weight_bytes_before: int = 0  # the swapped layers' weights as they were
    weight_bytes_after: int = 0  # the same layers' weights as stored now
    rss_before: int = 0
    rss_after: int = 0
    seconds: float = 0.0
    max_abs_diff: float = 0.0  # q4: largest |packed weight - loaded weight| over all packed layers
    stacked: list[str] = field(default_factory=list)  # q4: swapped layers now slices of one int4 layer with siblings
    kernels: dict[str, int] = field(default_factory=dict)  # q4: what runs the swapped layers' few rows -> layers
    rounded: list[str] = field(default_factory=list)  # q4: layers rounded to Q8_0 here (option.quantize_lm_head)

    def describe(self) -> str:
        kept = "; ".join(f"{name} ({why})" for name, why in self.kept.items()) or "none"
        stacked = f" ({len(self.stacked)} of them stacked with siblings of the same input)" if self.stacked else ""
        stacked += f" ({', '.join(self.rounded)} rounded to Q8_0 at load)" if self.rounded else ""
        where = " (a few rows on: " + ", ".join(f"{kernel} {count}" for kernel, count in self.kernels.items()) + \
            ")" if self.kernels else ""
        return (f"option.quantize={self.mode}: {len(self.swapped)} Linear layers swapped{stacked} in "
                f"{self.seconds:.1f} s{where}, their weights {self.weight_bytes_before / 2**20:.0f} MiB -> "
                f"{self.weight_bytes_after / 2**20:.0f} MiB; process RSS {self.rss_before / 2**20:.0f} -> "
                f"{self.rss_after / 2**20:.0f} MiB; kept as loaded: {kept}")


def check_quantizable(model: Any, mode: str, device: torch.device, gguf: Path | None) -> None:
    """Refuse, before anything is swapped, what cannot work: a GPU, q4 without a Q4 GGUF or Q4Blocks file
    (`gguf`: either) or in a dtype the int4 kernel does not compute in, fp16 from weights that are not fp32."""
    if mode == "none":
        return
    if torch.device(device).type != "cpu":
        raise QuantizeError(f"option.quantize={mode}: the fp16 / int4 kernels are CPU kernels and the model is on "
                            f"{device}; on a GPU use option.dtype=fp16 or bf16 and option.quantize=none")
    if mode == "q4" and gguf is None:
        raise QuantizeError("option.quantize=q4 runs a checkpoint's own 4-bit weights, and this model was loaded "
                            "from neither a GGUF file nor a 4-bit AWQ / GPTQ / compressed-tensors checkpoint: give a "
                            "Q4_0 / Q4_1 / Q4_K(_M) GGUF (option.model_id / option.gguf_file) or such a "
                            "checkpoint, or use option.quantize=fp16")
    dtype = _weights_dtype(model)
    allowed = Q4_ACTIVATIONS if mode == "q4" else (torch.float32,)
    if dtype is not None and dtype not in allowed:
        names = " or ".join(str(d).removeprefix("torch.").replace("float32", "fp32").replace("bfloat16", "bf16")
                            for d in allowed)
        raise QuantizeError(f"option.quantize={mode} computes in {names}, and this model was loaded in "
                            f"{str(dtype).removeprefix('torch.')}; set option.dtype accordingly")


def _weights_dtype(model: Any) -> torch.dtype | None:
    """The dtype of the model's first plain Linear layer (the dtype it computes in), or None if it has none."""
    if not isinstance(model, nn.Module):
        return None
    return next((linear.weight.dtype for _, linear in plain_linears(model)), None)


def quantize_model(model: nn.Module, mode: str, device: torch.device, gguf: Path | None = None, *,
                   lm_head_int8: bool = False) -> QuantizeReport:
    """Swap `model`'s Linear modules for `mode` (one of MODES) in place; `gguf` is the file whose 4-bit weights
    q4 reads: the GGUF the model was converted from, or the Q4Blocks file of a pre-quantized checkpoint
    (block_file.NAME); `lm_head_int8` (option.quantize_lm_head): q4 rounds an lm_head that file leaves
    unquantized to Q8_0 blocks (`_rounded_lm_head`). Raises QuantizeError when the mode cannot apply."""
    if mode not in MODES:
        raise QuantizeError(f"option.quantize: {mode!r} is not one of {', '.join(MODES)}")
    check_quantizable(model, mode, device, gguf)
    report = QuantizeReport(mode)
    if mode == "none":
        return report
    started, report.rss_before = time.monotonic(), process_rss()
    if mode == "fp16":
        _swap_fp16(model, report)
    else:
        _swap_q4(model, gguf, report, lm_head_int8)
    own_remaining_tensors(model)
    gc.collect()
    return_freed_memory()
    report.seconds, report.rss_after = time.monotonic() - started, process_rss()
    log.info("%s", report.describe())
    return report


def _swap_fp16(model: nn.Module, report: QuantizeReport) -> None:
    with torch.no_grad():
        for name, linear in plain_linears(model):
            new = Fp16Linear(linear)
            report.weight_bytes_before += linear.weight.numel() * linear.weight.element_size()
            report.weight_bytes_after += new.stored_bytes()
            replace_module(model, name, new)
            report.swapped.append(name)


def _swap_q4(model: nn.Module, source: Path, report: QuantizeReport, lm_head_int8: bool) -> None:
    """Every Linear the source holds in Q4 blocks that match its loaded weights is replaced (q/k/v and
    gate/up by one stacked int4 layer each), and with bf16 activations on a VNNI CPU every one a GGUF holds
    in Q8_0 blocks (a tied lm_head: the embedding's); the blocks are all read and checked before the first
    replacement goes in."""
    dtype = _weights_dtype(model)  # the one the layers compute in (check_quantizable allowed it)
    read = _block_file_blocks if source.name == BLOCK_FILE else _gguf_blocks
    checked = read(model, source, dtype, report)
    if lm_head_int8:
        _rounded_lm_head(model, checked, dtype, report)
    if not checked:  # a Q8_0 GGUF or a W8A8 checkpoint has int8 layers only: they run where they fit
        raise QuantizeError(f"option.quantize=q4: {source.name} holds no 4-bit weights of this model's Linear "
                            "layers (nor 8-bit ones it can run: those need option.dtype=bf16 on a CPU with "
                            "AVX-512 VNNI); use option.quantize=fp16")
    _swap_checked(model, checked, dtype, report)


_Blocks = Q4Blocks | Q8Blocks | CodeBlocks
_Checked = dict[str, tuple[_Blocks, nn.Linear]]  # Linear module -> its blocks (their type: the layer it becomes)


def _block_file_blocks(model: nn.Module, source: Path, dtype: torch.dtype | None, report: QuantizeReport) -> _Checked:
    """A pre-quantized checkpoint's blocks (block_file.py), checked against the loaded layers."""
    layers, kept = read_block_file(source)
    checked: _Checked = {}
    with torch.no_grad():
        for name, linear in plain_linears(model):
            blocks = layers.get(name)
            if blocks is None:
                report.kept[name] = kept.get(name, "not quantized in the checkpoint")
            elif blocks.q.shape != linear.weight.shape:
                report.kept[name] = f"blocks of shape {blocks.q.shape}, not the layer's"
            elif isinstance(blocks, Q8Blocks) and not q8_fits(linear.in_features, dtype):
                report.kept[name] = "int8: the VNNI kernel needs bf16 activations and a CPU with AVX-512 VNNI"
            elif isinstance(blocks, Q4Blocks) and linear.out_features % 16:
                report.kept[name] = f"{linear.out_features} rows, not a multiple of 16"
            else:
                report.max_abs_diff = max(report.max_abs_diff, _check_match(name, blocks, linear.weight))
                report.weight_bytes_before += linear.weight.numel() * linear.weight.element_size()
                checked[name] = (_on_block_kernel(blocks, linear.in_features, dtype), linear)
    return checked


def _on_block_kernel(blocks: Q4Blocks | Q8Blocks, in_features: int, dtype: torch.dtype | None) -> _Blocks:
    """A checkpoint's int8 layer as Q8_0 codes for the block kernel where it runs and its scales are exact in
    fp16 (the block kernel's; the VNNI kernel keeps fp32 ones): the layer chains take the block kernel's layers,
    so a W8A8 one-row step is ~0.8x the time it takes on the VNNI kernel. Other blocks as they are."""
    if not isinstance(blocks, Q8Blocks) or not block_fits(in_features, dtype):
        return blocks
    if not np.array_equal(blocks.scale.astype(np.float16).astype(np.float32), blocks.scale):
        return blocks
    return codes_of(blocks, "Q8_0")


def _rounded_lm_head(model: nn.Module, checked: _Checked, dtype: torch.dtype | None, report: QuantizeReport) -> None:
    """option.quantize_lm_head: an lm_head the checkpoint has no blocks for, as llama.cpp's Q8_0 of its loaded
    weights on the VNNI kernel (a tied one gets its own blocks: the input embedding keeps its weights)."""
    name = next((n for n, linear in plain_linears(model) if linear is model.get_output_embeddings()), None)
    if name is None or name in checked:
        return
    linear = model.get_output_embeddings()
    if not q8_fits(linear.in_features, dtype):
        report.kept[name] = report.kept.get(name, "not quantized") + (
            "; option.quantize_lm_head: the int8 kernel needs option.dtype=bf16, a width in multiples of 32 and a "
            "CPU with AVX-512 VNNI")
        return
    blocks = Q8Blocks.rounded(linear.weight)
    report.kept.pop(name, None)
    report.rounded.append(name)
    report.weight_bytes_before += linear.weight.numel() * linear.weight.element_size()
    checked[name] = (blocks, linear)


def _gguf_blocks(model: nn.Module, gguf: Path, dtype: torch.dtype | None, report: QuantizeReport) -> _Checked:
    """A GGUF's Q4 blocks (and its Q5_0 / Q6_K / Q8_0 ones where they run), checked against the loaded layers."""
    try:
        layers = read_gguf_linears(model, gguf)
    except KeyError as unknown:
        raise QuantizeError(f"option.quantize=q4: GGUF architecture {unknown} is unknown to the gguf package") from None
    checked: _Checked = {}
    with torch.no_grad():
        for name, linear in plain_linears(model):
            found = layers.tensors.get(name)
            source = found if found is not None or not _tied(model, linear) else layers.embedding
            kind = None if source is None else source.tensor_type.name
            blocks = None
            if kind in _Q4_TYPES and linear.out_features % 16 == 0:  # torch's kernel packs rows by 16 / 32 / 64
                blocks = unpack_q4_blocks(np.asarray(source.data), kind)
            elif kind in _WIDER_TYPES:
                blocks = _wider_blocks(np.asarray(source.data), kind, linear.in_features, dtype)
                if linear is not model.get_output_embeddings():  # a lone lm_head: the VNNI kernel reads it as fast
                    blocks = None if blocks is None else _on_block_kernel(blocks, linear.in_features, dtype)
            if blocks is not None:
                checked[name] = (_checked(name, blocks, linear, layers, report), linear)
            elif kind in _Q4_TYPES:
                report.kept[name] = f"{linear.out_features} rows, not a multiple of 16"
            else:
                report.kept[name] = _why_kept(model, linear, found, layers.embedding)
    return checked


def _wider_blocks(raw: np.ndarray, kind: str, in_features: int, dtype: torch.dtype | None) -> Q8Blocks | CodeBlocks | None:
    """A Q5_0 / Q6_K / Q8_0 layer's blocks in the form its kernel here takes (None: none runs it)."""
    on_block, on_vnni = block_fits(in_features, dtype), q8_fits(in_features, dtype)
    if kind == "Q6_K":
        return unpack_q6_k_blocks(raw) if on_block else None
    if kind == "Q5_0" and on_block:
        return codes_of(unpack_q8_blocks(raw, kind), kind)
    if on_vnni:
        return unpack_q8_blocks(raw, kind)
    return codes_of(unpack_q8_blocks(raw, kind), kind) if on_block else None


def _stacked_parts(parts: list[_Blocks], in_features: int, dtype: torch.dtype | None) -> list | None:
    """Siblings' blocks as the block kernel's parts (int8 blocks as Q8_0 codes), or None where it cannot stack them."""
    if not block_fits(in_features, dtype):
        return None
    return merged([codes_of(p, "Q8_0") if isinstance(p, Q8Blocks) else p for p in parts])


def _swap_checked(model: nn.Module, checked: _Checked, dtype: torch.dtype | None, report: QuantizeReport) -> None:
    # bf16 on a CPU that computes it: many rows (prefill, a large batch) on a bf16 oneDNN copy of the loaded weights
    dense = dtype == torch.bfloat16 and torch.bfloat16 in packable_dtypes()

    def layer(blocks: _Blocks | list, linear: nn.Linear) -> nn.Module:
        copy = OneDnnLinear(linear) if dense else None
        if isinstance(blocks, Q4Blocks):
            return q4_linear(blocks, linear.bias, dtype, copy)
        if isinstance(blocks, Q8Blocks):
            return Q8Linear(blocks, linear.bias, copy)
        return BlockLinear(blocks if isinstance(blocks, list) else [blocks], linear.bias, copy)

    def build(names: list[str], _layers: list[nn.Linear]) -> nn.Module | None:
        """Siblings whose blocks all go on one kernel (int4 in one column order, int8, or the block kernel's
        formats, mixed), as one layer: one kernel call instead of three (two); the kernels compute each output
        element on its own, so the slices equal the separate layers bit for bit."""
        if any(name not in checked for name in names):
            return None
        parts = [checked[name][0] for name in names]
        stacked = concatenated_linear([checked[name][1] for name in names])
        if all(isinstance(p, Q8Blocks) for p in parts):
            return layer(Q8Blocks.concatenated(parts), stacked)
        if all(isinstance(p, Q4Blocks) for p in parts):
            return layer(Q4Blocks.concatenated(parts), stacked) if Q4Blocks.stackable(parts) else None
        joined = _stacked_parts(parts, stacked.in_features, dtype)
        return None if joined is None else layer(joined, stacked)

    with torch.no_grad():
        report.stacked = stack_groups(model, build)
        for name, (blocks, linear) in checked.items():
            if name not in report.stacked:
                replace_module(model, name, layer(blocks, linear))
    report.swapped = list(checked)
    layers = [module for module in model.modules() if isinstance(module, FewRowsLinear)]
    report.weight_bytes_after = sum(module.stored_bytes() for module in layers)
    report.kernels = _kernel_counts(layers)
    if dtype == torch.float32:
        log.warning("option.quantize=q4: torch's x86 int4 kernel is vectorized for bf16 activations only; with "
                    "fp32 activations (exact relative to the GGUF) it runs a scalar loop: q4 saves weight memory but "
                    "decodes far slower than fp32 (4.6x the step time at B=1, 42x at B=32, measured on an AVX2 "
                    "EPYC); option.dtype=bf16 runs it on its vector code")


def _kernel_counts(layers: list[nn.Module]) -> dict[str, int]:
    """Swapped layers (a stack counts once) by what runs their few rows: "Q4 kernel", "VNNI kernel", "torch int4",
    "block kernel (Q5_0 + Q8_0)", ..."""
    counts: dict[str, int] = {}
    for module in layers:
        if isinstance(module, BlockLinear):
            where = f"block kernel ({' + '.join(module.kernel_weights.formats)})"
        elif isinstance(module, Q8Linear):
            where = "VNNI kernel"
        else:
            where = "Q4 kernel" if module.kernel_weights is not None else "torch int4"
        counts[where] = counts.get(where, 0) + 1
    return counts


def _tied(model: nn.Module, linear: nn.Linear) -> bool:
    return getattr(model.config, "tie_word_embeddings", False) and linear is model.get_output_embeddings()


def _checked(name: str, blocks: Any, linear: nn.Linear, layers: GgufLinears, report: QuantizeReport) -> Any:
    """`blocks` in the loaded layer's row order, once they match its weights (QuantizeError if not)."""
    if name in layers.permuted_heads:
        blocks = permute_rows(blocks, layers.permuted_heads[name])
    report.max_abs_diff = max(report.max_abs_diff, _check_match(name, blocks, linear.weight))
    report.weight_bytes_before += linear.weight.numel() * linear.weight.element_size()
    return blocks


def _why_kept(model: nn.Module, linear: nn.Linear, found: Any, embedding: Any) -> str:
    if found is not None:
        return f"GGUF {found.tensor_type.name}"
    if _tied(model, linear) and embedding is not None:
        return f"tied to the input embedding, GGUF {embedding.tensor_type.name}"
    return "not in the GGUF"


def _check_match(name: str, blocks: _Blocks, weight: torch.Tensor) -> float:
    """The packed weights must be the loaded ones (the GGUF dequantized) up to the loaded dtype's rounding."""
    diff = float((blocks.dequantize() - weight.detach().float()).abs().max())
    scale = float(weight.detach().abs().max()) or 1.0
    if diff > _MATCH_TOLERANCE[weight.dtype] * scale:
        raise QuantizeError(f"option.quantize=q4: the 4-bit blocks for {name} differ from the loaded weights by "
                            f"{diff:.3g} (the model's weights are not those blocks'); use option.quantize=fp16")
    return diff
