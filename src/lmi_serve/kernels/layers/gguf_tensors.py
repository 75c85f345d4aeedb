"""A GGUF's tensors for a loaded model's Linear modules, by the gguf package's own name map, for
option.quantize=q4 (kernels/layers/quantize.py): which tensor holds each layer's blocks, the tied input
embedding's, and the rows llama.cpp stored in its rotary order."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from lmi_serve.kernels.layers.surgery import plain_linears


@dataclass(frozen=True)
class GgufLinears:
    tensors: dict[str, Any]  # Linear module name -> its GGUF tensor (a gguf.ReaderTensor)
    embedding: Any  # the input embedding's GGUF tensor, or None
    permuted_heads: dict[str, int]  # Linear module whose rows llama.cpp permuted -> its head count


def read_gguf_linears(model: nn.Module, gguf: Path) -> GgufLinears:
    """The GGUF tensors of `model`'s Linear modules, by gguf's own name map; Llama's attn_q / attn_k
    rows are stored in llama.cpp's rotary order (undone as transformers' GGUF loader does). KeyError: an
    architecture the gguf package does not know."""
    import gguf as gguf_lib

    reader = gguf_lib.GGUFReader(str(gguf))
    field_ = reader.fields["general.architecture"]
    arch_name = bytes(field_.parts[field_.data[0]]).decode()
    arch = next((k for k, v in gguf_lib.MODEL_ARCH_NAMES.items() if v == arch_name), None)
    if arch is None:
        raise KeyError(arch_name)
    config = model.config
    names = gguf_lib.get_tensor_name_map(arch, config.num_hidden_layers)
    by_name = {t.name: t for t in reader.tensors}
    tensors, permuted = {}, {}
    for module_name, _ in plain_linears(model):
        gguf_name = names.get_name(module_name)
        if gguf_name and f"{gguf_name}.weight" in by_name:
            tensors[module_name] = by_name[f"{gguf_name}.weight"]
            if arch_name == "llama" and gguf_name.endswith((".attn_q", ".attn_k")):
                kv = gguf_name.endswith(".attn_k")
                permuted[module_name] = config.num_key_value_heads if kv else config.num_attention_heads
    return GgufLinears(tensors, by_name.get("token_embd.weight"), permuted)


def permute_rows(blocks: Any, heads: int) -> Any:
    """Undo llama.cpp's rotary row order for one head count (rows are whole blocks, so it is exact)."""
    def undo(a: np.ndarray) -> np.ndarray:
        half = a.shape[0] // heads // 2
        return a.reshape(heads, half, 2, *a.shape[1:]).swapaxes(2, 1).reshape(a.shape)

    return blocks.permuted(undo)
