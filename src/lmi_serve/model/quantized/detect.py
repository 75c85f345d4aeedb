"""Recognise a pre-quantized checkpoint from its config.json `quantization_config` (torch-free).

`quantization_of(config)` names the format lmi-serve reads (AWQ GEMM, GPTQ v1/v2, compressed-tensors
W4A16 / W8A16 / W8A8 / FP8) as a `QuantFormat`, returns None for an unquantized config, and raises
ModelLoadError naming the method and what to use instead for anything else: a checkpoint we cannot
read must fail at load in one line, never load as something else or stop deep inside transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from lmi_serve.model.source import ModelLoadError

INSTEAD = ("use the unquantized checkpoint, or a GGUF of the model (its Q4_0/Q4_1/Q4_K blocks run with "
           "option.quantize=q4)")
# what to say for the methods we know and do not read
_REFUSED = {
    "bitsandbytes": "bitsandbytes quantizes on CUDA at load time; use the unquantized checkpoint it was made "
                    "from (with option.quantize=fp16 for lighter weights on a CPU), or a GGUF of the model",
    "exl2": "ExLlamaV2's format runs only in exllamav2; use an AWQ, GPTQ or GGUF copy of the model",
    "marlin": "Marlin's GPU tile layout; use the GPTQ or AWQ checkpoint it was repacked from",
    "gptq_marlin": "Marlin's GPU tile layout; use the GPTQ or AWQ checkpoint it was repacked from",
    "awq_marlin": "Marlin's GPU tile layout; use the GPTQ or AWQ checkpoint it was repacked from",
}
AWQ_VERSIONS = ("gemm",)
GPTQ_FORMATS = ("gptq", "gptq_v2")
_CT_INT_FORMATS = ("int-quantized", "naive-quantized")


@dataclass(frozen=True)
class QuantFormat:
    """A pre-quantized checkpoint's format as lmi-serve reads it."""

    method: str  # "awq", "gptq" or "compressed-tensors"
    scheme: str  # "W4A16", "W8A16", "W8A8" (int8 weights and activations) or "FP8"
    layout: str  # "gemm" (AWQ), "gptq" / "gptq_v2" (GPTQ), or compressed-tensors' format (pack-quantized, ...)
    bits: int
    group_size: int  # input columns per scale; -1: one per output channel (or per tensor, `strategy` says)
    symmetric: bool
    desc_act: bool = False  # GPTQ activation order (or compressed-tensors' actorder "group"): a g_idx per column
    strategy: str = "group"  # compressed-tensors: tensor, channel, group or block
    block_structure: tuple[int, int] | None = None  # FP8 block scales
    activations: str | None = None  # W8A8: how activations are quantized ("dynamic token", "static tensor", ...)
    not_converted: tuple[str, ...] = field(default_factory=tuple)  # modules the config leaves unquantized

    def describe(self) -> str:
        group = "per channel" if self.group_size <= 0 else f"group {self.group_size}"
        extra = ", desc_act" if self.desc_act else ""
        return (f"{self.method} {self.scheme} ({self.layout}, {self.bits}-bit, {group}, "
                f"{'symmetric' if self.symmetric else 'asymmetric'}{extra})")


def refuse(method: str, detail: str = "", instead: str = INSTEAD) -> ModelLoadError:
    what = f"{method} ({detail})" if detail else method
    return ModelLoadError(f"this checkpoint is quantized with {what}, which lmi-serve does not load: {instead}")


def quantization_of(config: dict[str, Any]) -> QuantFormat | None:
    """The pre-quantized format config.json (as a dict) declares, None when it declares none; a
    ModelLoadError naming the method and what to use instead for any other quantization."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise refuse(type(quant).__name__)
    method = str(quant.get("quant_method") or "").lower()
    if not method and (quant.get("load_in_4bit") or quant.get("load_in_8bit")):
        method = "bitsandbytes"
    if method == "awq":
        return _awq(quant)
    if method == "gptq":
        return _gptq(quant)
    if method == "compressed-tensors":
        return _compressed(quant)
    if method == "gguf":  # transformers' marker on a model it dequantized from a GGUF: plain floats
        return None
    raise refuse(method or "an unnamed method", instead=_REFUSED.get(method, INSTEAD))


def _awq(quant: dict[str, Any]) -> QuantFormat:
    version = str(quant.get("version") or "gemm").lower()
    if version not in AWQ_VERSIONS:
        raise refuse("awq", f"version {version!r}; only the GEMM packing is read",
                     "use an AWQ GEMM checkpoint (AutoAWQ's default), a GPTQ one, or a GGUF")
    backend = str(quant.get("backend") or "autoawq").lower()
    if backend != "autoawq":
        raise refuse("awq", f"backend {backend!r}", "use an AutoAWQ GEMM checkpoint, a GPTQ one, or a GGUF")
    bits = int(quant.get("bits", quant.get("w_bit", 4)))
    if bits != 4:
        raise refuse("awq", f"{bits}-bit", INSTEAD)
    if not quant.get("zero_point", True):
        raise refuse("awq", "zero_point false", INSTEAD)
    group = int(quant.get("group_size", quant.get("q_group_size", 128)))
    return QuantFormat("awq", "W4A16", "gemm", 4, group, symmetric=False,
                       not_converted=tuple(quant.get("modules_to_not_convert") or ()))


def _gptq(quant: dict[str, Any]) -> QuantFormat:
    if quant.get("is_marlin_format"):
        raise refuse("gptq", "is_marlin_format", _REFUSED["marlin"])
    layout = str(quant.get("checkpoint_format") or quant.get("format") or "gptq").lower()
    if layout not in GPTQ_FORMATS:
        raise refuse("gptq", f"checkpoint_format {layout!r}", _REFUSED.get(layout, _REFUSED["marlin"]))
    bits = int(quant.get("bits", 4))
    if bits not in (4, 8):
        raise refuse("gptq", f"{bits}-bit", "use a 4- or 8-bit GPTQ checkpoint, an AWQ one, or a GGUF")
    if quant.get("dynamic"):
        raise refuse("gptq", "per-module `dynamic` overrides", INSTEAD)
    if str(quant.get("pack_dtype") or "int32").removeprefix("torch.") != "int32":
        raise refuse("gptq", f"pack_dtype {quant['pack_dtype']}", INSTEAD)
    return QuantFormat("gptq", f"W{bits}A16", layout, bits, int(quant.get("group_size", 128)),
                       symmetric=bool(quant.get("sym", True)), desc_act=bool(quant.get("desc_act", False)))


def _compressed(quant: dict[str, Any]) -> QuantFormat:
    for key in ("transform_config", "sparsity_config"):
        value = quant.get(key)
        if value and not (key == "sparsity_config" and str(value.get("format", "dense")) == "dense"):
            raise refuse("compressed-tensors", f"a {key}", INSTEAD)
    groups = list((quant.get("config_groups") or {}).values())
    if not groups:
        raise refuse("compressed-tensors", "no config_groups", INSTEAD)
    schemes = {_ct_scheme(group, quant.get("format")) for group in groups}
    if len(schemes) > 1:
        raise refuse("compressed-tensors", "several schemes in one checkpoint (mixed precision)", INSTEAD)
    return replace(schemes.pop(), not_converted=tuple(quant.get("ignore") or ()))


def _ct_scheme(group: dict[str, Any], default_format: str | None) -> QuantFormat:
    """One config group's format, or a refusal naming it."""
    layout = str(group.get("format") or default_format or "")
    weights = group.get("weights") or {}
    inputs = group.get("input_activations")
    kind, bits = weights.get("type", "int"), int(weights.get("num_bits", 0))
    strategy = str(weights.get("strategy") or "tensor")
    group_size = int(weights.get("group_size") or -1) if strategy in ("group", "tensor_group") else -1
    desc_act = str(weights.get("actorder")) == "group" or weights.get("actorder") is True
    block = tuple(weights["block_structure"]) if weights.get("block_structure") else None
    acts = None
    if inputs:
        acts = f"{inputs.get('type', 'int')}{inputs.get('num_bits')} " + \
               f"{'dynamic' if inputs.get('dynamic') else 'static'} {inputs.get('strategy') or 'tensor'}"
    symmetric = bool(weights.get("symmetric", True))
    detail = f"format {layout!r}, {kind}{bits} weights" + (f", {acts} activations" if acts else "")
    if group.get("output_activations") or strategy == "tensor_group":
        raise refuse("compressed-tensors", detail, INSTEAD)
    if kind == "int" and layout == "pack-quantized" and bits in (4, 8) and not inputs and strategy != "block":
        return QuantFormat("compressed-tensors", f"W{bits}A16", layout, bits, group_size, symmetric, desc_act,
                           strategy)
    if kind == "int" and layout in _CT_INT_FORMATS and bits == 8 and strategy != "block":
        if inputs and not (inputs.get("type", "int") == "int" and int(inputs.get("num_bits", 0)) == 8):
            raise refuse("compressed-tensors", detail, INSTEAD)
        return QuantFormat("compressed-tensors", "W8A8" if inputs else "W8A16", layout, 8, group_size, symmetric,
                           desc_act, strategy, activations=acts)
    if kind == "float" and layout == "float-quantized" and bits == 8 and symmetric:
        return QuantFormat("compressed-tensors", "FP8", layout, 8, group_size, True, False, strategy, block, acts)
    raise refuse("compressed-tensors", detail, INSTEAD)
