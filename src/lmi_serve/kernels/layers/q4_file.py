"""A checkpoint's 4-bit layers as Q4Blocks, in one safetensors file beside its dequantized weights.

A pre-quantized checkpoint (AWQ, GPTQ, compressed-tensors W4A16) loads as the float model its weights stand
for (model/quantized/convert.py), and its 4-bit layers are also written here in the q4 path's own form, so
that option.quantize=q4 runs them on the int4 kernels as it runs a GGUF's Q4 blocks (kernels/layers/quantize.py).
Per Linear module `m`:

- `m.q`: uint8 [N, K / 2], two codes a byte (column 2j in the low nibble, 2j + 1 in the high one);
- `m.scale`, `m.zero`: float32 [N, K / 32];
- `m.columns`: int64 [K], only where the blocks hold the columns in another order (Q4Blocks.columns).

The file's metadata holds `kept`: a JSON object of the quantized layers that have no Q4 form, with the reason
(8-bit codes, groups that do not fill whole blocks of 32), so the start-up report can name them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from lmi_serve.kernels.layers.gguf_linears import Q4Blocks

NAME = "q4_blocks.safetensors"  # in the dequantized folder, beside its model weights
FORMAT = "lmi-serve-q4-blocks-1"


def write_q4_file(path: Path, layers: dict[str, Q4Blocks], kept: dict[str, str]) -> None:
    """Write `layers` (Linear module name -> its blocks) and the reasons the `kept` ones have none."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, blocks in layers.items():
        q = blocks.q
        tensors[f"{name}.q"] = torch.from_numpy(np.ascontiguousarray(q[:, 0::2] | (q[:, 1::2] << 4)))
        tensors[f"{name}.scale"] = torch.from_numpy(np.ascontiguousarray(blocks.scale, dtype=np.float32))
        tensors[f"{name}.zero"] = torch.from_numpy(np.ascontiguousarray(blocks.zero, dtype=np.float32))
        if blocks.columns is not None:
            tensors[f"{name}.columns"] = torch.from_numpy(np.ascontiguousarray(blocks.columns, dtype=np.int64))
    save_file(tensors, str(path), metadata={"format": FORMAT, "kept": json.dumps(kept)})


def read_q4_file(path: Path) -> tuple[dict[str, Q4Blocks], dict[str, str]]:
    """(Linear module name -> Q4Blocks, quantized layer -> why it has no Q4 form) from `write_q4_file`'s file."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as handle:
        metadata = handle.metadata() or {}
        if metadata.get("format") != FORMAT:
            raise ValueError(f"{path} is not a {FORMAT} file (format {metadata.get('format')!r})")
        names = {key.rpartition(".")[0] for key in handle.keys()}
        layers = {}
        for name in sorted(names):
            packed = handle.get_tensor(f"{name}.q")
            q = np.empty((packed.shape[0], packed.shape[1] * 2), np.uint8)
            q[:, 0::2], q[:, 1::2] = packed & 0x0F, packed >> 4
            columns = handle.get_tensor(f"{name}.columns") if f"{name}.columns" in handle.keys() else None
            layers[name] = Q4Blocks(q, handle.get_tensor(f"{name}.scale"), handle.get_tensor(f"{name}.zero"), columns)
    return layers, json.loads(metadata.get("kept") or "{}")
