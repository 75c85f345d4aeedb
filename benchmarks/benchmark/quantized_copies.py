"""AWQ and GPTQ copies of a plain safetensors model folder, packed by our own packers (lmi_serve.model.quantized),
for the benchmarks: what a user's AWQ / GPTQ checkpoint of the model would hold, with round-to-nearest codes
(min-max per group, no calibration: a copy to time and to gate, not AWQ's or GPTQ's search).

    awq       AutoAWQ GEMM, 4-bit, asymmetric, group GROUP
    gptq      GPTQ v1 (AutoGPTQ), 4-bit, symmetric, group GROUP, desc_act false
    gptq-act  GPTQ v1 with desc_act: each input's columns in an activation order (here: by the column norms of the
              first layer that reads the input, so q/k/v and gate/up share one order, as GPTQ's Hessian of their
              common input gives them), `g_idx` per column
    w8a8      compressed-tensors `int-quantized` W8A8: int8 weights, symmetric, one scale per output channel;
              activations int8, dynamic, per token (llm-compressor's W8A8 scheme)

Every decoder Linear is packed (q/k/v/o, gate/up/down); lm_head and the embeddings stay as they are. A copy is
written once under `~/.cache/lmi-serve/bench-quantized/<format>-<source folder name>` and reused.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from lmi_serve.model.quantized.awq import pack_awq
from lmi_serve.model.quantized.gptq import pack_gptq
from lmi_serve.model.quantized.weights import consecutive_groups, quantize_int

GROUP = 64  # SmolLM2-135M's width, 576, is 9 groups of 64 (not whole groups of 128)
FORMATS = ("awq", "gptq", "gptq-act", "w8a8")
_LINEAR = re.compile(r"(.*\.layers\.\d+\.(self_attn|mlp))\.(\w+_proj)\.weight$")
_FIRST_READER = {"q_proj": "q_proj", "k_proj": "q_proj", "v_proj": "q_proj", "o_proj": "o_proj",
                 "gate_proj": "gate_proj", "up_proj": "gate_proj", "down_proj": "down_proj"}
_CONFIG = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True,
             "checkpoint_format": "gptq"},
    "gptq-act": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": True,
                 "checkpoint_format": "gptq"},
    "w8a8": {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
             "ignore": ["lm_head"], "config_groups": {"group_0": {
                 "targets": ["Linear"], "format": "int-quantized",
                 "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                 "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                       "dynamic": True}}}},
}


def quantized_copy(source: Path, fmt: str, cache: Path = Path("~/.cache/lmi-serve/bench-quantized")) -> Path:
    """The `fmt` copy of the plain folder `source` (one model.safetensors), written once."""
    from safetensors.torch import load_file, save_file

    target = cache.expanduser() / f"{fmt}-{source.name}"
    if (target / "config.json").is_file():
        return target
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging, ignore=shutil.ignore_patterns("*.safetensors", "*.json.lock"))
    plain = load_file(str(source / "model.safetensors"))
    packed: dict[str, torch.Tensor] = {}
    for name, tensor in plain.items():
        match = _LINEAR.match(name)
        if not match:
            packed[name] = tensor
            continue
        order = None
        if fmt == "gptq-act":
            reader = plain[f"{match.group(1)}.{_FIRST_READER[match.group(3)]}.weight"].float()
            order = torch.argsort(reader.norm(dim=0), descending=True, stable=True)
        packed.update({f"{name.removesuffix('.weight')}.{part}": value.contiguous()
                       for part, value in _pack(tensor.float(), fmt, order).items()})
    save_file(packed, str(staging / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = _CONFIG[fmt]
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    staging.rename(target)
    return target


def _pack(weight: torch.Tensor, fmt: str, order: torch.Tensor | None) -> dict[str, torch.Tensor]:
    if fmt == "w8a8":  # int8 = round(w / s), s = max |w| / 127 per output channel, stored as bf16 (as llm-compressor)
        scale = (weight.abs().amax(1, keepdim=True) / 127).clamp(min=2.0**-20).to(torch.bfloat16)
        return {"weight": torch.round(weight / scale.float()).clamp(-127, 127).to(torch.int8), "weight_scale": scale}
    if fmt == "awq":
        return pack_awq(quantize_int(weight, 4, GROUP, symmetric=False))
    g_idx = None
    if order is not None:  # column order[k] is the k-th quantized: its group is k // GROUP
        g_idx = torch.empty_like(order)
        g_idx[order] = consecutive_groups(weight.shape[1], GROUP)
    return pack_gptq(quantize_int(weight, 4, GROUP, symmetric=True, g_idx=g_idx))
