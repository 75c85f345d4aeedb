"""How much memory a model will take once loaded, and whether it fits what is left: the accounting
behind SageMaker multi-model endpoints' 507 (serving/multi_model.py), decided before loading so that a
model that would not fit is refused instead of the container being OOM-killed.

    estimate = weights at the load dtype (from the files' tensor shapes: safetensors headers, GGUF
               tensor infos; pickled .bin files by their size) + K/V for `max_rolling_batch_size` rows
               of KV_TOKENS_PER_ROW tokens (text generation only)
    limit    = option.mme_memory_limit, else LIMIT_SHARE of the container's memory (the smallest of its
               cgroups' v2 memory.max and v1 memory.limit_in_bytes, else MemTotal)
    fits     = the estimates of the models loaded + this one <= limit

Once a model has loaded, what it holds grows by the row kernel's copies of its fp32 Linear weights
(multi_model.kernel_copies; kernels/footprint.py), known only after the kernel plan ran on this host.

On a CPU the K/V grows with the rows' real lengths instead of being reserved up front, so the K/V term
is an allowance for a busy model, not its worst case (every row at the full context).
"""

from __future__ import annotations

import json
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from lmi_serve import cgroup

#: Share of the container's memory the models may take when option.mme_memory_limit is unset: the rest
#: is the server itself (torch, tokenizers, request buffers) and the allocator's slack.
LIMIT_SHARE = 0.85
#: K/V tokens per row counted for a generation model (see the module docstring)
KV_TOKENS_PER_ROW = 512

# bytes per element of a safetensors dtype
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
# bytes per element in memory at the load dtype; `auto` counts as fp32, what it picks on most CPUs
_LOAD_BYTES = {"fp32": 4, "float32": 4, "auto": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2}


def container_memory(root: Path = cgroup.ROOT) -> int:
    """The memory this container may use: the smallest limit of its cgroups (v2 memory.max, v1
    memory.limit_in_bytes, at every level up from its own: lmi_serve/cgroup.py), else the machine's."""
    total = _meminfo_total(root / "proc/meminfo")
    limits = [total]
    for folder in cgroup.folders("memory", root):
        text = cgroup.read(folder.path / ("memory.max" if folder.version == 2 else "memory.limit_in_bytes"))
        if text and text.isdigit() and int(text) > 0:  # "max", or v1's huge number (above total), means no limit
            limits.append(int(text))
    return min(limits)


def _meminfo_total(meminfo: Path) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"{meminfo} has no MemTotal")


def weights_bytes(folders: list[Path], dtype: str) -> int:
    """The weights' bytes in memory once loaded at `dtype`, from the files in `folders` (a GGUF is
    dequantized, so its quantized size on disk says little)."""
    per_element = _LOAD_BYTES.get(dtype, 4)
    total = 0
    for folder in folders:
        for path in sorted(folder.glob("*.safetensors")):
            total += _safetensors_elements(path) * per_element
        for path in sorted(folder.glob("*.gguf")):
            total += _gguf_elements(path) * per_element
        if not any(folder.glob("*.safetensors")):
            total += sum(path.stat().st_size for path in folder.glob("*.bin"))  # pickled: their size
    return total


def _safetensors_elements(path: Path) -> int:
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    count = 0
    for name, entry in header.items():
        if name != "__metadata__":
            elements = 1
            for dim in entry["shape"]:
                elements *= dim
            count += elements
    return count


def _gguf_elements(path: Path) -> int:
    from gguf import GGUFReader  # the tensor infos only; the data stays memory-mapped

    return sum(int(tensor.n_elements) for tensor in GGUFReader(str(path)).tensors)


def kv_bytes(config_json: Path, rows: int, dtype: str) -> int:
    """K/V of `rows` rows of KV_TOKENS_PER_ROW tokens, from config.json's layers and heads (0 without one)."""
    try:
        config = json.loads(config_json.read_text())
    except (OSError, ValueError):
        return 0
    config = config.get("text_config", config)
    layers = config.get("num_hidden_layers") or 0
    heads = config.get("num_attention_heads") or 1
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (config.get("hidden_size") or 0) // heads
    return 2 * layers * kv_heads * head_dim * _LOAD_BYTES.get(dtype, 4) * KV_TOKENS_PER_ROW * rows


@dataclass(frozen=True)
class Refusal:
    """Why a model does not fit: its estimate, what the loaded ones take, the limit."""

    estimate: int
    in_use: int
    limit: int

    def message(self, name: str) -> str:
        mib = 2**20
        return (f"Model {name} needs about {self.estimate / mib:.0f} MiB (weights at the load dtype and K/V), "
                f"the loaded models take {self.in_use / mib:.0f} MiB, and the limit is {self.limit / mib:.0f} MiB "
                "(option.mme_memory_limit, else 85% of the container's memory): unload a model, then retry")


class MemoryBudget:
    """The loaded models' estimates against the limit; reserve before loading, release on unload."""

    def __init__(self, limit: int):
        self.limit = limit
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def in_use(self) -> int:
        return sum(self._held.values())

    def reserve(self, name: str, estimate: int) -> Refusal | None:
        """Hold `estimate` bytes for `name` if they fit; else the Refusal (nothing held)."""
        with self._lock:
            if self.in_use + estimate > self.limit:
                return Refusal(estimate, self.in_use, self.limit)
            self._held[name] = estimate
            return None

    def hold(self, name: str, estimate: int) -> None:
        """Count `estimate` bytes for `name` whatever the limit (a model already in memory)."""
        with self._lock:
            self._held[name] = estimate

    def held(self, name: str) -> int:
        with self._lock:
            return self._held.get(name, 0)

    def release(self, name: str) -> None:
        with self._lock:
            self._held.pop(name, None)
