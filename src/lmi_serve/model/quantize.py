"""Opt-in lighter weights (`option.quantize`): swap a loaded model's `nn.Linear` modules in place.

Pure model surgery: no engine, no HTTP. The model stays a transformers model; only its Linear
modules are replaced, so every KV implementation and both batching modes work unchanged.

- ``fp16``: weights stored in fp16, compute in fp32 (fbgemm's ``linear_prepack_fp16`` /
  ``linear_dynamic_fp16``), on every Linear including lm_head. The output equals fp32 ``F.linear``
  with the weights rounded to fp16. A tied lm_head gets its own fp16 copy: the input embedding
  keeps its fp32 weight.
- ``q4``: 4-bit weight-only from the GGUF's own Q4_0 / Q4_1 blocks, lossless relative to that GGUF:
  Q4_1 is w = d*q + m per 32-weight block, i.e. group-wise asymmetric int4 with group 32, which
  torch's x86 int4 kernel computes as (q - 8) * scale + zero with scale = d, zero = m + 8d (Q4_0:
  w = d*(q - 8), zero = 0). Activations keep the model's dtype: fp32 (exact relative to the GGUF,
  but the kernel has vector code for bf16 activations only, so fp32 is a slow scalar loop) or bf16
  (a model loaded with option.dtype=bf16: the fast path, its scales and zeros rounded to bf16 as the
  kernel takes them; more than Q4_MAX_ROWS rows go to a bf16 oneDNN copy of the loaded weights, where
  the CPU computes bf16, since the int4 kernel computes row by row). Linear layers the GGUF holds
  in another type (SmolLM2's lm_head is tied to a Q8_0 embedding) keep their loaded weights. Each
  packed layer is checked against the loaded weight (the dequantized GGUF, rounded to the model's
  dtype) before it replaces it. The int4 kernel computes each row on its own: a row's output does
  not depend on the others in the batch (the bf16 copy's does).

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

from lmi_serve.model.linear_kernels import OneDnnLinear, packable_dtypes
from lmi_serve.model.shared_input import concatenated_linear, stack_groups
from lmi_serve.model.surgery import own_remaining_tensors, process_rss, replace_module, return_freed_memory

log = logging.getLogger(__name__)

MODES = ("none", "fp16", "q4")
Q4_GROUP = 32  # weights per GGUF Q4 block: one scale (and min) per 32 input columns
Q4_MAX_ROWS = 8  # bf16 q4 layers: more rows than this go to their bf16 oneDNN copy (Q4Linear)
_Q4_TYPES = ("Q4_0", "Q4_1")
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

    def describe(self) -> str:
        kept = "; ".join(f"{name} ({why})" for name, why in self.kept.items()) or "none"
        stacked = f" ({len(self.stacked)} of them stacked with siblings of the same input)" if self.stacked else ""
        return (f"option.quantize={self.mode}: {len(self.swapped)} Linear layers swapped{stacked} in "
                f"{self.seconds:.1f} s, their weights {self.weight_bytes_before / 2**20:.0f} MiB -> "
                f"{self.weight_bytes_after / 2**20:.0f} MiB; process RSS {self.rss_before / 2**20:.0f} -> "
                f"{self.rss_after / 2**20:.0f} MiB; kept as loaded: {kept}")


class Fp16Linear(nn.Module):
    """`nn.Linear` with fp16-stored weights and fp32 compute (fbgemm). Holds no fp32 weight."""

    weight = None  # none to read: models that cast to `layer.weight.dtype` when it is a Tensor (T5) skip that

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float().contiguous()
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self._packed = torch.ops.quantized.linear_prepack_fp16(weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self._packed)

    def stored_bytes(self) -> int:
        return self.in_features * self.out_features * 2

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=fp16"


@dataclass(frozen=True)
class Q4Blocks:
    """One layer's GGUF Q4 blocks, unpacked: q in 0..15 and per-block scale and zero, so that
    weight[n, k] = (q[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32]."""

    q: np.ndarray  # [N, K] uint8
    scale: np.ndarray  # [N, K / 32] float32
    zero: np.ndarray  # [N, K / 32] float32

    @staticmethod
    def concatenated(parts: list[Q4Blocks]) -> Q4Blocks:
        """The blocks of one layer whose rows are `parts`' rows, one after the other."""
        return Q4Blocks(*(np.concatenate([getattr(p, name) for p in parts]) for name in ("q", "scale", "zero")))

    def dequantize(self) -> torch.Tensor:
        scale = torch.from_numpy(self.scale).repeat_interleave(Q4_GROUP, dim=1)
        zero = torch.from_numpy(self.zero).repeat_interleave(Q4_GROUP, dim=1)
        return (torch.from_numpy(self.q.astype(np.float32)) - 8) * scale + zero


def unpack_q4_blocks(raw: np.ndarray, type_name: str) -> Q4Blocks:
    """A GGUF Q4_0 / Q4_1 tensor's bytes ([N, K/32 * block bytes] uint8) as Q4Blocks.

    Block layout (ggml): Q4_1 = d (fp16), m (fp16), 16 bytes of nibbles; Q4_0 = d (fp16), 16 bytes.
    Byte j holds element j in its low nibble and element j + 16 in its high nibble."""
    head = 4 if type_name == "Q4_1" else 2
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, head + Q4_GROUP // 2)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., head:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, -1)
    if type_name == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        return Q4Blocks(q, d, m + 8 * d)
    return Q4Blocks(q, d, np.zeros_like(d))


class Q4Linear(nn.Module):
    """`nn.Linear` on 4-bit weights with activations in `dtype` (fp32 or bf16; the kernel takes its
    scales and zeros in the activations' dtype): torch's x86 int4 kernel (`_weight_int4pack_mm_for_cpu`,
    group 32). With `dense` (the same layer on oneDNN's bf16 matmul), more than Q4_MAX_ROWS rows go there:
    the int4 kernel computes row by row (a matrix-vector loop), fastest for a few rows, and a GEMM wins
    above (SmolLM2's layer set at 1 / 8 / 32 rows: int4 66 / 180 / 671 µs, bf16 oneDNN 163 / 200 / 375 µs)."""

    weight = None  # as Fp16Linear's

    def __init__(self, blocks: Q4Blocks, bias: torch.Tensor | None, dtype: torch.dtype = torch.float32,
                 dense: nn.Module | None = None):
        super().__init__()
        self.out_features, self.in_features = blocks.q.shape
        self.dtype = dtype
        self.dense = dense
        q = torch.from_numpy(blocks.q.astype(np.int32))
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        scale_zero = np.stack([blocks.scale.T, blocks.zero.T], axis=-1)  # [K/32, N, 2]
        self.register_buffer("scale_zero", torch.from_numpy(np.ascontiguousarray(scale_zero)).to(dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # each call skipped where it would be a no-op: 120 of these a SmolLM2 step, ~1 µs a call at one row
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if flat.dtype != self.dtype:
            flat = flat.to(self.dtype)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        if self.dense is not None and flat.shape[0] > Q4_MAX_ROWS:
            out = self.dense(flat)
        else:  # the buffers read from their dicts, not through nn.Module.__getattr__ (3 a call)
            buffers = self._buffers
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, buffers["packed"], Q4_GROUP, buffers["scale_zero"])
            bias = self._parameters.get("bias")
            if bias is not None:
                out = out + bias
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)

    def stored_bytes(self) -> int:
        dense = 0 if self.dense is None else self.in_features * self.out_features * 2  # its packed bf16 copy
        int4 = self.packed.numel() * self.packed.element_size()
        return int4 + self.scale_zero.numel() * self.scale_zero.element_size() + dense

    def extra_repr(self) -> str:
        activations = str(self.dtype).removeprefix("torch.")
        dense = f", above {Q4_MAX_ROWS} rows bf16 oneDNN" if self.dense is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, weights=int4 group {Q4_GROUP}, "
                f"activations={activations}{dense}")


def _linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The plain nn.Linear modules: a subclass has its own forward (Llama 4's router returns a tuple)."""
    return [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear]


def check_quantizable(model: Any, mode: str, device: torch.device, gguf: Path | None) -> None:
    """Refuse, before anything is swapped, what cannot work: a GPU, q4 without a Q4 GGUF or in a dtype
    the int4 kernel does not compute in, fp16 from weights that are not fp32."""
    if mode == "none":
        return
    if torch.device(device).type != "cpu":
        raise QuantizeError(f"option.quantize={mode}: the fp16 / int4 kernels are CPU kernels and the model is on "
                            f"{device}; on a GPU use option.dtype=fp16 or bf16 and option.quantize=none")
    if mode == "q4" and gguf is None:
        raise QuantizeError("option.quantize=q4 reads the GGUF's own 4-bit blocks, and this model was not loaded "
                            "from a GGUF file: give a Q4_0 / Q4_1 GGUF (option.model_id / option.gguf_file), or use "
                            "option.quantize=fp16")
    dtype = _weights_dtype(model)
    allowed = Q4_ACTIVATIONS if mode == "q4" else (torch.float32,)
    if dtype is not None and dtype not in allowed:
        names = " or ".join(str(d).removeprefix("torch.").replace("float32", "fp32").replace("bfloat16", "bf16")
                            for d in allowed)
        raise QuantizeError(f"option.quantize={mode} computes in {names}, and this model was loaded in "
                            f"{str(dtype).removeprefix('torch.')}; set option.dtype accordingly")


def _weights_dtype(model: Any) -> torch.dtype | None:
    """The dtype of the model's first plain Linear layer (the dtype it computes in), or None if it has none."""
    return next((linear.weight.dtype for _, linear in _linears(model)), None) if isinstance(model, nn.Module) else None


def quantize_model(model: nn.Module, mode: str, device: torch.device, gguf: Path | None = None) -> QuantizeReport:
    """Swap `model`'s Linear modules for `mode` (one of MODES) in place; `gguf` is the file the model
    was converted from (needed by q4). Raises QuantizeError when the mode cannot apply."""
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
        _swap_q4(model, gguf, report)
    own_remaining_tensors(model)
    gc.collect()
    return_freed_memory()
    report.seconds, report.rss_after = time.monotonic() - started, process_rss()
    log.info("%s", report.describe())
    return report


def _swap_fp16(model: nn.Module, report: QuantizeReport) -> None:
    with torch.no_grad():
        for name, linear in _linears(model):
            new = Fp16Linear(linear)
            report.weight_bytes_before += linear.weight.numel() * linear.weight.element_size()
            report.weight_bytes_after += new.stored_bytes()
            replace_module(model, name, new)
            report.swapped.append(name)


def _swap_q4(model: nn.Module, gguf: Path, report: QuantizeReport) -> None:
    """Every Linear the GGUF holds in Q4 blocks that match its loaded weights is replaced (q/k/v and
    gate/up by one stacked int4 layer each); the blocks are all read and checked before the first
    replacement goes in."""
    layers = _read_gguf_linears(model, gguf)
    checked: dict[str, tuple[Q4Blocks, nn.Linear]] = {}
    dtype = _weights_dtype(model)  # the one the layers compute in (check_quantizable allowed it)
    with torch.no_grad():
        for name, linear in _linears(model):
            found = layers.tensors.get(name)
            if found is None or found.tensor_type.name not in _Q4_TYPES:
                report.kept[name] = _why_kept(model, linear, found, layers.embedding)
            elif linear.out_features % 16:  # the kernel packs rows in blocks of 16 / 32 / 64
                report.kept[name] = f"{linear.out_features} rows, not a multiple of 16"
            else:
                blocks = unpack_q4_blocks(np.asarray(found.data), found.tensor_type.name)
                if name in layers.permuted_heads:
                    blocks = _permute_rows(blocks, layers.permuted_heads[name])
                report.max_abs_diff = max(report.max_abs_diff, _check_match(name, blocks, linear.weight))
                checked[name] = (blocks, linear)
                report.weight_bytes_before += linear.weight.numel() * linear.weight.element_size()
    if not checked:
        raise QuantizeError(f"option.quantize=q4: {gguf.name} holds no Q4_0 / Q4_1 weights of this model's Linear "
                            "layers; use option.quantize=fp16")

    # bf16 on a CPU that computes it: many rows (prefill, a large batch) on a bf16 oneDNN copy of the loaded weights
    dense = dtype == torch.bfloat16 and torch.bfloat16 in packable_dtypes()

    def q4_linear(blocks: Q4Blocks, linear: nn.Linear) -> Q4Linear:
        return Q4Linear(blocks, linear.bias, dtype, OneDnnLinear(linear) if dense else None)

    def build(names: list[str], _layers: list[nn.Linear]) -> Q4Linear | None:
        """Siblings whose blocks all go int4, as one layer: one kernel call instead of three (two); the
        kernel computes each output element on its own, so the slices equal the separate layers bit for bit."""
        if any(name not in checked for name in names):
            return None
        return q4_linear(Q4Blocks.concatenated([checked[name][0] for name in names]),
                         concatenated_linear([checked[name][1] for name in names]))

    with torch.no_grad():
        report.stacked = stack_groups(model, build)
        for name, (blocks, linear) in checked.items():
            if name not in report.stacked:
                replace_module(model, name, q4_linear(blocks, linear))
    report.swapped = list(checked)
    report.weight_bytes_after = sum(module.stored_bytes() for module in model.modules() if isinstance(module, Q4Linear))
    if dtype == torch.float32:
        log.warning("option.quantize=q4: torch's x86 int4 kernel is vectorized for bf16 activations only; with "
                    "fp32 activations (exact relative to the GGUF) it runs a scalar loop: q4 saves weight memory but "
                    "decodes far slower than fp32 (4.6x the step time at B=1, 42x at B=32, measured on an AVX2 "
                    "EPYC); option.dtype=bf16 runs it on its vector code")


def _why_kept(model: nn.Module, linear: nn.Linear, found: Any, embedding: Any) -> str:
    if found is not None:
        return f"GGUF {found.tensor_type.name}"
    tied = getattr(model.config, "tie_word_embeddings", False) and linear is model.get_output_embeddings()
    if tied and embedding is not None:
        return f"tied to the input embedding, GGUF {embedding.tensor_type.name}"
    return "not in the GGUF"


@dataclass(frozen=True)
class _GgufLinears:
    tensors: dict[str, Any]  # Linear module name -> its GGUF tensor (a gguf.ReaderTensor)
    embedding: Any  # the input embedding's GGUF tensor, or None
    permuted_heads: dict[str, int]  # Linear module whose rows llama.cpp permuted -> its head count


def _read_gguf_linears(model: nn.Module, gguf: Path) -> _GgufLinears:
    """The GGUF tensors of `model`'s Linear modules, by gguf's own name map; Llama's attn_q / attn_k
    rows are stored in llama.cpp's rotary order (undone as transformers' GGUF loader does)."""
    import gguf as gguf_lib

    reader = gguf_lib.GGUFReader(str(gguf))
    field_ = reader.fields["general.architecture"]
    arch_name = bytes(field_.parts[field_.data[0]]).decode()
    arch = next((k for k, v in gguf_lib.MODEL_ARCH_NAMES.items() if v == arch_name), None)
    if arch is None:
        raise QuantizeError(f"option.quantize=q4: GGUF architecture {arch_name!r} is unknown to the gguf package")
    config = model.config
    names = gguf_lib.get_tensor_name_map(arch, config.num_hidden_layers)
    by_name = {t.name: t for t in reader.tensors}
    tensors, permuted = {}, {}
    for module_name, _ in _linears(model):
        gguf_name = names.get_name(module_name)
        if gguf_name and f"{gguf_name}.weight" in by_name:
            tensors[module_name] = by_name[f"{gguf_name}.weight"]
            if arch_name == "llama" and gguf_name.endswith((".attn_q", ".attn_k")):
                kv = gguf_name.endswith(".attn_k")
                permuted[module_name] = config.num_key_value_heads if kv else config.num_attention_heads
    return _GgufLinears(tensors, by_name.get("token_embd.weight"), permuted)


def _permute_rows(blocks: Q4Blocks, heads: int) -> Q4Blocks:
    """Undo llama.cpp's rotary row order for one head count (rows are whole blocks, so it is exact)."""
    def undo(a: np.ndarray) -> np.ndarray:
        half = a.shape[0] // heads // 2
        return a.reshape(heads, half, 2, *a.shape[1:]).swapaxes(2, 1).reshape(a.shape)

    return Q4Blocks(undo(blocks.q), undo(blocks.scale), undo(blocks.zero))


def _check_match(name: str, blocks: Q4Blocks, weight: torch.Tensor) -> float:
    """The packed weights must be the loaded ones (the GGUF dequantized) up to the loaded dtype's rounding."""
    diff = float((blocks.dequantize() - weight.detach().float()).abs().max())
    scale = float(weight.detach().abs().max()) or 1.0
    if diff > _MATCH_TOLERANCE[weight.dtype] * scale:
        raise QuantizeError(f"option.quantize=q4: the GGUF's blocks for {name} differ from the loaded weights by "
                            f"{diff:.3g} (the model's weights are not that GGUF's); use option.quantize=fp16")
    return diff
