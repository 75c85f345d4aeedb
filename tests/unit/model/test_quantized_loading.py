"""Loading a pre-quantized checkpoint (model/quantized/convert.py through model/loader.py).

A tiny Llama's Linear layers are quantized and packed here in each format (AWQ, GPTQ v1 with desc_act,
GPTQ v2 8-bit, compressed-tensors W4A16 / W8A8 / FP8), with the config.json `quantization_config` its
tools write. `load_generation_model` loads it with no quantization library: its logits equal those of
the same model holding the dequantized weights, and a second start reuses the dequantized folder. A
checkpoint of a method we do not read fails at load with one line naming it.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmi_serve.model.loader import load_generation_model
from lmi_serve.model.quantized.awq import pack_awq
from lmi_serve.model.quantized.gptq import pack_gptq
from lmi_serve.model.quantized.weights import dequantize, pack_int32, quantize_int
from lmi_serve.model.source import ModelLoadError
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


def _gptq(bits, layout, desc_act):
    def pack(weight):
        g_idx = None
        if desc_act:
            order = torch.randperm(weight.shape[1], generator=torch.Generator().manual_seed(weight.shape[0]))
            g_idx = torch.empty_like(order)
            g_idx[order] = torch.arange(weight.shape[1]) // 32
        quantized = quantize_int(weight, bits, 32, symmetric=not desc_act, g_idx=g_idx)
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


FORMATS = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}, _awq),
    "gptq-v1-desc_act": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False,
                          "checkpoint_format": "gptq"}, _gptq(4, "gptq", True)),
    "gptq-v2-8bit": ({"quant_method": "gptq", "bits": 8, "group_size": 32, "desc_act": False, "sym": True,
                      "checkpoint_format": "gptq_v2"}, _gptq(8, "gptq_v2", False)),
    "ct-w4a16": (_ct_config("pack-quantized", {"num_bits": 4, "type": "int", "symmetric": False,
                                               "strategy": "group", "group_size": 32}), _ct_w4a16),
    "ct-w8a8": (_ct_config("int-quantized", {"num_bits": 8, "type": "int", "strategy": "channel"},
                           {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}), _ct_w8a8),
    "ct-fp8": (_ct_config("float-quantized", {"num_bits": 8, "type": "float", "strategy": "channel"}), _ct_fp8),
}


def _write(folder: Path, files: dict[str, bytes]) -> Path:
    folder.mkdir(parents=True)
    for name, content in files.items():
        (folder / name).write_bytes(content)
    return folder


def _quantized_checkpoint(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """(the quantized folder, a plain folder holding its dequantized weights: the reference)."""
    quant_config, pack = FORMATS[name]
    files = tiny_llama_files()
    quantized_dir = _write(tmp_path / name, {k: v for k, v in files.items() if k != "model.safetensors"})
    reference_dir = _write(tmp_path / f"{name}-reference", files)
    plain = load_file(str(reference_dir / "model.safetensors"))
    packed, reference = {}, {}
    for tensor_name, tensor in plain.items():
        if LINEAR.match(tensor_name):
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


def _logits(folder: Path, cache_dir: Path) -> torch.Tensor:
    loaded = load_generation_model(str(folder), cache_dir=str(cache_dir))
    with torch.inference_mode():
        return loaded.model(input_ids=torch.tensor(IDS)).logits


@pytest.mark.parametrize("name", list(FORMATS))
def test_quantized_checkpoint_loads_as_its_dequantized_model(tmp_path, name):
    quantized_dir, reference_dir = _quantized_checkpoint(tmp_path, name)
    cache = tmp_path / "cache"
    logits = _logits(quantized_dir, cache)
    assert torch.equal(logits, _logits(reference_dir, cache))
    folders = [f for f in (cache / "dequantized").iterdir() if f.is_dir()]
    assert len(folders) == 1 and "quantization_config" not in json.loads((folders[0] / "config.json").read_text())
    built = (folders[0] / "model.safetensors").stat().st_mtime_ns
    assert torch.equal(_logits(quantized_dir, cache), logits)  # a second start reuses the folder
    assert (folders[0] / "model.safetensors").stat().st_mtime_ns == built


@pytest.mark.parametrize("name,side_file", [("gptq-v1-desc_act", "quantize_config.json"), ("awq", "quant_config.json")])
def test_quantization_declared_beside_config_json_is_read(tmp_path, name, side_file):
    """AutoGPTQ's quantize_config.json and AutoAWQ's quant_config.json, with no quantization_config in
    config.json: read, not loaded as a model whose quantized layers are missing (random)."""
    quantized_dir, reference_dir = _quantized_checkpoint(tmp_path, name)
    config = json.loads((quantized_dir / "config.json").read_text())
    side = config.pop("quantization_config")
    side.pop("quant_method")
    if side_file == "quant_config.json":  # AutoAWQ's own key names
        side = {"w_bit": side["bits"], "q_group_size": side["group_size"], "zero_point": True, "version": "GEMM"}
    (quantized_dir / side_file).write_text(json.dumps(side))
    (quantized_dir / "config.json").write_text(json.dumps(config))
    cache = tmp_path / "cache"
    assert torch.equal(_logits(quantized_dir, cache), _logits(reference_dir, cache))


@pytest.mark.parametrize("quant,named", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "bitsandbytes"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "marlin")])
def test_unsupported_quantization_fails_at_load_naming_it(tmp_path, quant, named):
    files = tiny_llama_files()
    config = json.loads(files["config.json"])
    config["quantization_config"] = quant
    folder = _write(tmp_path / "model", {**files, "config.json": json.dumps(config).encode()})
    with pytest.raises(ModelLoadError, match=named) as refused:
        load_generation_model(str(folder), cache_dir=str(tmp_path / "cache"))
    assert "\n" not in str(refused.value)
