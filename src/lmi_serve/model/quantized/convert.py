"""Load a pre-quantized checkpoint by dequantizing it once into a plain safetensors folder.

An AWQ, GPTQ or compressed-tensors checkpoint loads as the float model its quantized weights stand
for: every quantized Linear's tensors are unpacked
(awq.py, gptq.py, compressed.py) and dequantized in float32, where each value is exact (weights.py),
and written with the checkpoint's other tensors and files into a folder under the cache dir, as a GGUF
is (model/loader.py convert_gguf). transformers then loads that folder like any other, in the dtype
option.dtype picks, with no gptqmodel, autoawq or compressed-tensors installed. The folder is keyed by
the checkpoint's bytes, so later starts reuse it. It holds float32 weights: 8x the int4 checkpoint's
size on disk, fine for the small models served on a CPU. Its 4-bit and symmetric 8-bit layers are also
written in the kernels' block form (blocks.py, kernels/layers/block_file.py), which option.quantize=q4 runs
on the int4 and int8 kernels.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from lmi_serve.kernels.layers.block_file import NAME as BLOCK_FILE
from lmi_serve.kernels.layers.block_file import write_block_file
from lmi_serve.model.cache_folder import built_once
from lmi_serve.model.quantized.awq import unpack_awq
from lmi_serve.model.quantized.blocks import kernel_blocks
from lmi_serve.model.quantized.compressed import dequantize_fp8, int8_weight, unpack_pack_quantized
from lmi_serve.model.quantized.detect import QuantFormat, quantization_of
from lmi_serve.model.quantized.gptq import unpack_gptq
from lmi_serve.model.quantized.weights import IntWeight, dequantize

log = logging.getLogger(__name__)

LAYOUT_VERSION = "3"  # bump when the folder's contents change for the same checkpoint
# where older tools declared the quantization: beside config.json, not in it
SIDE_CONFIGS = {"quantize_config.json": "gptq", "quant_config.json": "awq"}
INDEX = "model.safetensors.index.json"
# per-layer tensors the plain model does not have: activation and KV-cache scales of static schemes
_DROPPED = ("input_scale", "input_zero_point", "input_global_scale", "output_scale", "output_zero_point",
            "k_scale", "v_scale", "kv_scale")
# the tensor that marks a quantized layer, per method, and the companions read with it
_MAIN = {"awq": "qweight", "gptq": "qweight", "compressed-tensors": "weight_packed"}
_COMPANIONS = ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale", "weight_shape",
               "weight_zero_point", "weight_g_idx")


def dequantize_if_quantized(source: str, cache_dir: str) -> str:
    """`source` itself when its config.json declares no quantization; the dequantized folder of a format
    we read (built once); a ModelLoadError naming any other method (detect.py)."""
    config_file = Path(source) / "config.json"
    if not config_file.is_file():
        return source
    config = json.loads(config_file.read_text())
    found = quantization_of(_with_side_config(Path(source), config))
    if found is None:
        return source
    log.info("%s is %s: loading it as the float weights it stands for%s", source, found.describe(),
             "; option.quantize=q4 with option.dtype=bf16 runs its quantized layers on the int4 / int8 kernels"
             if found.scheme != "FP8" else "")
    return str(dequantized_folder(Path(source), found, cache_dir))


def _with_side_config(source: Path, config: dict[str, Any]) -> dict[str, Any]:
    """`config`, with the quantization an older checkpoint declares beside it when config.json does not:
    AutoGPTQ's `quantize_config.json` (GPTQ) or AutoAWQ's `quant_config.json` (AWQ). Without this such a
    folder would load with its quantized layers missing, i.e. random."""
    if config.get("quantization_config"):
        return config
    for name, method in SIDE_CONFIGS.items():
        if (source / name).is_file():
            side = json.loads((source / name).read_text())
            return {**config, "quantization_config": {"quant_method": method, **side}}
    return config


def dequantized_folder(source: Path, found: QuantFormat, cache_dir: str) -> Path:
    """Build (once: model/cache_folder.py) and return the plain folder of `source`."""

    def build(staging: Path) -> None:
        started = time.monotonic()
        layers = _write_weights(source, found, staging)
        _write_other_files(source, staging)
        log.info("Dequantized %d quantized layers of %s in %.1f s", layers, source, time.monotonic() - started)

    return built_once(_cache_folder(source, cache_dir), build)


def _weight_files(source: Path) -> list[Path]:
    index = source / INDEX
    if index.is_file():
        return [source / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(source.glob("*.safetensors"))
    if not files:
        from lmi_serve.model.source import ModelLoadError

        raise ModelLoadError(f"{source}: a pre-quantized checkpoint without .safetensors weights is not read")
    return files


def _cache_folder(source: Path, cache_dir: str) -> Path:
    """Keyed by the bytes of config.json and every weight file (not by path or mtime, as a GGUF's)."""
    content = hashlib.sha256(LAYOUT_VERSION.encode())
    for path in [source / "config.json", *_weight_files(source)]:
        with open(path, "rb") as file:
            while chunk := file.read(1 << 20):
                content.update(chunk)
    return Path(cache_dir).expanduser() / "dequantized" / f"{source.name}-{content.hexdigest()[:16]}"


def _write_weights(source: Path, found: QuantFormat, target: Path) -> int:
    """Each weight file of `source` as a plain one of the same name in `target` (a quantized layer's
    companions may sit in another file: every file stays open); returns how many layers were dequantized."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    files = _weight_files(source)
    handles = {path.name: safe_open(str(path), framework="pt") for path in files}
    where = {name: file for file, handle in handles.items() for name in handle.keys()}
    weight_map: dict[str, str] = {}
    blocks_of, kept = {}, {}
    layers = 0
    for path in files:
        tensors: dict[str, torch.Tensor] = {}
        for name in handles[path.name].keys():
            prefix, _, leaf = name.rpartition(".")
            if leaf in _DROPPED:
                continue
            if leaf == _MAIN[found.method] or _is_quantized_weight(found, leaf, handles[path.name], name):
                parts = {part: handles[where[f"{prefix}.{part}"]].get_tensor(f"{prefix}.{part}")
                         for part in (*_COMPANIONS, "weight") if f"{prefix}.{part}" in where}
                int_weight = _int_weight(found, parts)
                if int_weight is None:
                    tensors[f"{prefix}.weight"] = dequantize_fp8(parts["weight"], parts["weight_scale"],
                                                                 found.block_structure).contiguous()
                    kept[prefix] = "FP8 weights"
                else:
                    tensors[f"{prefix}.weight"] = dequantize(int_weight).contiguous()
                    blocks = kernel_blocks(int_weight)
                    if isinstance(blocks, str):
                        kept[prefix] = blocks
                    else:
                        blocks_of[prefix] = blocks
                layers += 1
            elif leaf not in _COMPANIONS:
                tensors[name] = handles[path.name].get_tensor(name)
        save_file(tensors, str(target / path.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, path.name))
    if len(files) > 1:
        (target / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    if blocks_of:
        write_block_file(target / BLOCK_FILE, blocks_of, kept)
    return layers


def _is_quantized_weight(found: QuantFormat, leaf: str, handle: Any, name: str) -> bool:
    """compressed-tensors int8 / FP8 layers keep the name `weight`, with an int8 or float8 dtype."""
    if found.method != "compressed-tensors" or leaf != "weight":
        return False
    return handle.get_slice(name).get_dtype() in ("I8", "F8_E4M3", "F8_E5M2")


def _int_weight(found: QuantFormat, parts: dict[str, torch.Tensor]) -> IntWeight | None:
    """One quantized layer's `IntWeight` from its tensors (the format's module docstring names them); None
    for FP8 (float codes)."""
    if found.method == "awq":
        return unpack_awq(parts["qweight"], parts["qzeros"], parts["scales"])
    if found.method == "gptq":
        return unpack_gptq(parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"),
                           bits=found.bits, group_size=found.group_size, checkpoint_format=found.layout)
    if "weight_packed" in parts:
        return unpack_pack_quantized(parts["weight_packed"], parts["weight_scale"], parts["weight_shape"],
                                     bits=found.bits, weight_zero_point=parts.get("weight_zero_point"),
                                     weight_g_idx=parts.get("weight_g_idx"))
    if parts["weight"].dtype == torch.int8:
        return int8_weight(parts["weight"], parts["weight_scale"], parts.get("weight_zero_point"),
                           parts.get("weight_g_idx"))
    return None


def _write_other_files(source: Path, target: Path) -> None:
    """config.json without its quantization_config, and every other non-weight file as it is."""
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config", None)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    skipped = {"config.json", INDEX, *SIDE_CONFIGS}
    for path in source.iterdir():
        if path.is_file() and path.name not in skipped and path.suffix not in (".safetensors", ".bin", ".pt"):
            shutil.copy2(path, target / path.name)
