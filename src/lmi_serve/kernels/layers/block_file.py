"""A checkpoint's quantized layers as Q4Blocks / Q8Blocks, in one safetensors file beside its dequantized weights.

A pre-quantized checkpoint (AWQ, GPTQ, compressed-tensors) loads as the float model its weights stand for
(model/quantized/convert.py), and its 4-bit and symmetric 8-bit layers are also written here in the kernels'
own block form, so that option.quantize=q4 runs them as it runs a GGUF's Q4 and Q8_0 blocks
(kernels/layers/quantize.py). Per Linear module `m`, one of:

- Q4: `m.q4` uint8 [N, K / 2], two codes a byte (column 2j in the low nibble, 2j + 1 in the high one);
  `m.scale`, `m.zero` float32 [N, K / 32]; `m.columns` int64 [K] only where the blocks hold the columns in
  another order (Q4Blocks.columns);
- Q8: `m.q8` int8 [N, K]; `m.scale` float32 [N, K / 32].

The file's metadata holds `kept`: a JSON object of the quantized layers that have no block form, with the
reason (asymmetric 8-bit codes, groups that do not fill whole blocks of 32), so the start-up report names them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from lmi_serve.kernels.layers.gguf_linears import Q4Blocks, Q8Blocks

NAME = "quantized_blocks.safetensors"  # in the dequantized folder, beside its model weights
FORMAT = "lmi-serve-blocks-1"


def _tensor(array: np.ndarray, dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=dtype))


def write_block_file(path: Path, layers: dict[str, Q4Blocks | Q8Blocks], kept: dict[str, str]) -> None:
    """Write `layers` (Linear module name -> its blocks) and the reasons the `kept` ones have none."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, blocks in layers.items():
        tensors[f"{name}.scale"] = _tensor(blocks.scale, np.float32)
        if isinstance(blocks, Q8Blocks):
            tensors[f"{name}.q8"] = _tensor(blocks.q, np.int8)
            continue
        tensors[f"{name}.q4"] = _tensor(blocks.q[:, 0::2] | (blocks.q[:, 1::2] << 4), np.uint8)
        tensors[f"{name}.zero"] = _tensor(blocks.zero, np.float32)
        if blocks.columns is not None:
            tensors[f"{name}.columns"] = _tensor(blocks.columns, np.int64)
    save_file(tensors, str(path), metadata={"format": FORMAT, "kept": json.dumps(kept)})


def read_block_file(path: Path) -> tuple[dict[str, Q4Blocks | Q8Blocks], dict[str, str]]:
    """(Linear module name -> its blocks, quantized layer -> why it has none) from `write_block_file`'s file."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as handle:
        metadata = handle.metadata() or {}
        if metadata.get("format") != FORMAT:
            raise ValueError(f"{path} is not a {FORMAT} file (format {metadata.get('format')!r})")
        keys = set(handle.keys())
        layers: dict[str, Q4Blocks | Q8Blocks] = {}
        for name in sorted(key.rpartition(".")[0] for key in keys if key.endswith(".scale")):
            scale = handle.get_tensor(f"{name}.scale")
            if f"{name}.q8" in keys:
                layers[name] = Q8Blocks(handle.get_tensor(f"{name}.q8"), scale)
                continue
            packed = handle.get_tensor(f"{name}.q4")
            q = np.empty((packed.shape[0], packed.shape[1] * 2), np.uint8)
            q[:, 0::2], q[:, 1::2] = packed & 0x0F, packed >> 4
            columns = handle.get_tensor(f"{name}.columns") if f"{name}.columns" in keys else None
            layers[name] = Q4Blocks(q, scale, handle.get_tensor(f"{name}.zero"), columns)
    return layers, json.loads(metadata.get("kept") or "{}")
