"""Pre-quantized checkpoints of a tiny Llama for the tests, packed by our own packers (model/quantized/) from its
weights in each format (AWQ, GPTQ v1 with desc_act, GPTQ v2 8-bit, compressed-tensors W4A16 / W8A8 / FP8),
with the config.json `quantization_config` its tools write, and the plain folder of the weights they stand for."""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save, save_file

from lmi_serve.model.quantized.awq import pack_awq
from lmi_serve.model.quantized.gptq import pack_gptq
from lmi_serve.model.quantized.weights import dequantize, pack_int32, quantize_int
from tiny_hub_model import tiny_llama_files

LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")
IDS = [[1, 17, 99, 3, 250, 40, 7, 300], [5, 8, 7, 6, 5, 4, 3, 2]]


def _ct_config(layout: str, weights: dict, inputs: dict | None = None) -> dict:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs, "format": layout}
    return {"quant_method": "compressed-tensors", "format": layout, "config_groups": {"group_0": group},
            "ignore": ["lm_head"], "quantization_status": "compressed"}


def _awq(weight):
    quantized = quantize_int(weight, 4, 32, symmetric=False)
    return pack_awq(quantized), dequantize(quantized)


def _gptq(bits, layout, desc_act, group=32):
    def pack(weight):
        g_idx = None
        if desc_act:
            order = torch.randperm(weight.shape[1], generator=torch.Generator().manual_seed(weight.shape[0]))
            g_idx = torch.empty_like(order)
            g_idx[order] = torch.arange(weight.shape[1]) // 32
        quantized = quantize_int(weight, bits, group, symmetric=not desc_act, g_idx=g_idx)
        return pack_gptq(quantized, layout), dequantize(quantized)
    return pack


def _ct_w4a16(weight):
    quantized = quantize_int(weight, 4, 32, symmetric=False)
    return ({"weight_packed": pack_int32(quantized.codes, 4, dim=1),
             "weight_scale": quantized.scales.to(torch.bfloat16),
             "weight_zero_point": pack_int32(quantized.zeros.to(torch.uint8), 4, dim=0),
             "weight_shape": torch.tensor(weight.shape)},
            dequantize(replace(quantized, scales=quantized.scales.to(torch.bfloat16).float())))


def _ct_w8a8(weight):
    scale = (weight.abs().amax(1, keepdim=True) / 127).to(torch.bfloat16).float()
    int8 = torch.round(weight / scale).clamp(-128, 127).to(torch.int8)
    return {"weight": int8, "weight_scale": scale.to(torch.bfloat16), "input_scale": torch.ones(1)}, int8 * scale


def _ct_fp8(weight):
    scale = weight.abs().amax(1, keepdim=True) / 448
    fp8 = (weight / scale).to(torch.float8_e4m3fn)
    return {"weight": fp8, "weight_scale": scale}, fp8.float() * scale


# name -> (config.json's quantization_config, packer: float weight -> (its tensors, the weight they stand for))
FORMATS = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}, _awq),
    "gptq-v1-desc_act": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False,
                          "checkpoint_format": "gptq"}, _gptq(4, "gptq", True)),
    "gptq-v1-g64": ({"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": True,
                     "checkpoint_format": "gptq"}, _gptq(4, "gptq", False, 64)),
    "gptq-v2-8bit": ({"quant_method": "gptq", "bits": 8, "group_size": 32, "desc_act": False, "sym": True,
                      "checkpoint_format": "gptq_v2"}, _gptq(8, "gptq_v2", False)),
    "ct-w4a16": (_ct_config("pack-quantized", {"num_bits": 4, "type": "int", "symmetric": False,
                                               "strategy": "group", "group_size": 32}), _ct_w4a16),
    "ct-w8a8": (_ct_config("int-quantized", {"num_bits": 8, "type": "int", "strategy": "channel"},
                           {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}), _ct_w8a8),
    "ct-fp8": (_ct_config("float-quantized", {"num_bits": 8, "type": "float", "strategy": "channel"}), _ct_fp8),
}


def write_folder(folder: Path, files: dict[str, bytes]) -> Path:
    folder.mkdir(parents=True)
    for name, content in files.items():
        (folder / name).write_bytes(content)
    return folder


def _untied(files: dict[str, bytes]) -> dict[str, bytes]:
    """The tiny model with an lm_head of its own (the embedding's values), as a quantized lm_head needs."""
    config = json.loads(files["config.json"])
    config["tie_word_embeddings"] = False
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "model.safetensors").write_bytes(files["model.safetensors"])
        tensors = load_file(str(Path(folder) / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    return {**files, "config.json": json.dumps(config).encode(), "model.safetensors": save(tensors)}


def quantized_checkpoint(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """(the quantized folder, a plain folder holding its dequantized weights: the reference). A name ending in
    `+lm_head` packs the lm_head too (GPTQModel's `lm_head: true`), on the model untied."""
    name, _, with_head = name.partition("+")
    quant_config, pack = FORMATS[name]
    files = tiny_llama_files()
    if with_head:
        files, quant_config = _untied(files), {**quant_config, "lm_head": True}
        name = f"{name}-lm_head"
    quantized_dir = write_folder(tmp_path / name, {k: v for k, v in files.items() if k != "model.safetensors"})
    reference_dir = write_folder(tmp_path / f"{name}-reference", files)
    plain = load_file(str(reference_dir / "model.safetensors"))
    packed, reference = {}, {}
    for tensor_name, tensor in plain.items():
        if LINEAR.match(tensor_name) or (with_head and tensor_name == "lm_head.weight"):
            prefix = tensor_name.removesuffix(".weight")
            parts, reference[tensor_name] = pack(tensor)
            packed.update({f"{prefix}.{part}": value.contiguous() for part, value in parts.items()})
        else:
            packed[tensor_name] = reference[tensor_name] = tensor
    save_file(packed, str(quantized_dir / "model.safetensors"))
    save_file(reference, str(reference_dir / "model.safetensors"))
    config = json.loads(files["config.json"])
    config["quantization_config"] = quant_config
    (quantized_dir / "config.json").write_text(json.dumps(config))
    return quantized_dir, reference_dir
