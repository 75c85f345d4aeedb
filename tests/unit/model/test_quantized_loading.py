"""Loading a pre-quantized checkpoint (model/quantized/convert.py through model/loader.py).

A tiny Llama's Linear layers are quantized and packed here in each format (AWQ, GPTQ v1 with desc_act,
GPTQ v2 8-bit, compressed-tensors W4A16 / W8A8 / FP8), with the config.json `quantization_config` its
tools write. `load_generation_model` loads it with no quantization library: its logits equal those of
the same model holding the dequantized weights, and a second start reuses the dequantized folder. A
checkpoint of a method we do not read fails at load with one line naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmi_serve.model.loader import load_generation_model
from lmi_serve.model.source import ModelLoadError
from quantized_checkpoints import FORMATS, IDS, quantized_checkpoint, write_folder
from tiny_hub_model import tiny_llama_files


def _logits(folder: Path, cache_dir: Path) -> torch.Tensor:
    loaded = load_generation_model(str(folder), cache_dir=str(cache_dir))
    with torch.inference_mode():
        return loaded.model(input_ids=torch.tensor(IDS)).logits


@pytest.mark.parametrize("name", list(FORMATS))
def test_quantized_checkpoint_loads_as_its_dequantized_model(tmp_path, name):
    quantized_dir, reference_dir = quantized_checkpoint(tmp_path, name)
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
    quantized_dir, reference_dir = quantized_checkpoint(tmp_path, name)
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
    folder = write_folder(tmp_path / "model", {**files, "config.json": json.dumps(config).encode()})
    with pytest.raises(ModelLoadError, match=named) as refused:
        load_generation_model(str(folder), cache_dir=str(tmp_path / "cache"))
    assert "\n" not in str(refused.value)
