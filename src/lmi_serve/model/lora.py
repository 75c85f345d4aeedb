"""LoRA adapters on the served model (`option.enable_lora`): model surgery and per-row routing, no engine.

`LoraModel.wrap(model)` puts a `LoraLinear` around every linear layer of the model but its output
head (after option.quantize and option.linear_kernel, so the base layer inside is whatever those made
of it: an oneDNN-packed fp32 layer by default). A LoraLinear holds, per adapter slot, that adapter's
(A, B, scale) for its layer, and computes

    y = base(x);  y[rows of slot s] += scale_s * (x[rows of s] @ A_s^T) @ B_s^T   for each slot s in the forward

so one forward serves rows of different adapters, and rows without one get `base(x)` untouched:
bit for bit the logits of the model without LoRA. The per-row choice is set for each forward by
`LoraRouter.rows(slots)` (the engine's batch knows its rows' slots); the layers read it, so the KV
cache code that calls the model's forward needs no new argument.

This is PEFT's mixed-adapter batch (`adapter_names`: a sub-batch per adapter, `index_select` then
add) written for slots that come and go at run time and for a base layer PEFT does not know. The
adapters themselves are PEFT's format, read here: `adapter_config.json` (parsed by PEFT's own
`LoraConfig`) and `adapter_model.safetensors`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lmi_serve.kernels.layers.linear_kernels import OneDnnLinear, on_onednn
from lmi_serve.kernels.layers.surgery import replace_module

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."  # PEFT's saved keys: base_model.model.<module>.lora_A.weight
LORA_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class AdapterError(ValueError):
    """An adapter folder this model cannot serve; the message says which file and why."""


@dataclass(frozen=True)
class AdapterSpec:
    """A checked PEFT LoRA adapter folder: what registration validated, enough to load it again."""

    src: Path
    rank: int  # the largest r of its layers
    alpha: float
    use_rslora: bool
    targets: tuple[str, ...]  # the model's module names it adapts
    base_model: str | None  # adapter_config.json's base_model_name_or_path, shown, not enforced


@dataclass(frozen=True)
class LoraWeights:
    """One layer's part of one adapter: A [r, in], B [out, r] and the scale alpha / r (or / sqrt r).
    `down` / `up`: x -> x A^T and -> B^T as layers of the base layer's kernel (`on_kernel_of`)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float
    down: nn.Module | None = None
    up: nn.Module | None = None

    def on_kernel_of(self, base: nn.Module) -> "LoraWeights":
        """These weights as layers of `base`'s kernel: oneDNN-packed when `base` is (same dtype), so a forward
        never switches between oneDNN's and MKL's thread teams per layer (that switch made a decode
        step of 16 rows with one adapter 5-9x slower than without on a 2-core machine)."""
        def layer(weight: torch.Tensor) -> nn.Module:
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            linear.weight = nn.Parameter(weight, requires_grad=False)
            if on_onednn(base) and weight.dtype == base.dtype:  # fp32, or bf16 on a CPU computing it
                return OneDnnLinear(linear)
            return linear
        return LoraWeights(self.a, self.b, self.scale, layer(self.a), layer(self.b))


def read_adapter(src: str | Path, layers: dict[str, tuple[int, int]], max_rank: int) -> AdapterSpec:
    """Check a PEFT LoRA folder against the model (`layers`: module name -> (in, out) features of the
    layers LoRA can adapt) and `max_rank`; raise AdapterError naming what is wrong. Reads only the
    config and the safetensors header, not the weights."""
    from peft import LoraConfig
    from safetensors import safe_open

    folder = Path(src)
    if not folder.is_dir():
        raise AdapterError(f"{folder} is not a directory")
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (folder / name).is_file():
            raise AdapterError(f"{folder} holds no {name} (a PEFT LoRA adapter folder has {ADAPTER_CONFIG} and "
                               f"{ADAPTER_WEIGHTS})")
    try:
        raw = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        config = LoraConfig.from_pretrained(str(folder)) if raw.get("peft_type", "LORA") == "LORA" else None
    except (ValueError, TypeError) as exc:
        raise AdapterError(f"{folder / ADAPTER_CONFIG}: {exc}") from None
    if config is None:
        raise AdapterError(f"{folder / ADAPTER_CONFIG}: peft_type {raw.get('peft_type')!r} is not LORA")
    _refuse_unsupported(config, folder)
    shapes = _lora_shapes(folder / ADAPTER_WEIGHTS, safe_open)
    rank = 0
    for module, (a_shape, b_shape) in shapes.items():
        if module not in layers:
            raise AdapterError(f"{folder.name}: adapts {module}, which is not a linear layer of this model "
                               "that LoRA can adapt")
        r, features_in = a_shape
        features_out, r_b = b_shape
        if r_b != r or (features_in, features_out) != layers[module]:
            raise AdapterError(f"{folder.name}: {module} has lora_A {list(a_shape)} and lora_B {list(b_shape)}, "
                               f"which do not fit the layer's {layers[module][0]} -> {layers[module][1]} features")
        rank = max(rank, r)
    if rank > max_rank:
        raise AdapterError(f"{folder.name}: rank {rank} is over option.max_lora_rank ({max_rank})")
    return AdapterSpec(folder, rank, float(config.lora_alpha), bool(config.use_rslora), tuple(sorted(shapes)),
                       config.base_model_name_or_path)


def _refuse_unsupported(config, folder: Path) -> None:
    """What this LoRA does not compute (it would be silently wrong): refuse it at registration."""
    unsupported = {
        "use_dora": bool(getattr(config, "use_dora", False)),
        "alpha_pattern": bool(getattr(config, "alpha_pattern", None)),
        "modules_to_save": bool(getattr(config, "modules_to_save", None)),
        "layer_replication": bool(getattr(config, "layer_replication", None)),
        "lora_bias": bool(getattr(config, "lora_bias", False)),
        "bias": getattr(config, "bias", "none") != "none",
    }
    named = [key for key, used in unsupported.items() if used]
    if named:
        raise AdapterError(f"{folder / ADAPTER_CONFIG}: {', '.join(named)} is not supported (plain LoRA on "
                           "linear layers only)")


def _lora_shapes(path: Path, safe_open) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """module name -> (lora_A shape, lora_B shape), from the file's header."""
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                module, kind = _split_key(key, path)
                pairs.setdefault(module, {})[kind] = tuple(f.get_slice(key).get_shape())
    except AdapterError:
        raise
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise AdapterError(f"{path}: not a readable safetensors file ({exc})") from None
    if not pairs:
        raise AdapterError(f"{path}: holds no LoRA weights")
    for module, kinds in pairs.items():
        if set(kinds) != {"A", "B"} or len(kinds["A"]) != 2 or len(kinds["B"]) != 2:
            raise AdapterError(f"{path}: {module} needs a 2-D lora_A and lora_B weight")
    return {module: (kinds["A"], kinds["B"]) for module, kinds in pairs.items()}


def _split_key(key: str, path: Path) -> tuple[str, str]:
    """`base_model.model.<module>.lora_A.weight` -> (module, "A")."""
    for kind in ("A", "B"):
        suffix = f".lora_{kind}.weight"
        if key.startswith(_PREFIX) and key.endswith(suffix):
            return key[len(_PREFIX):-len(suffix)], kind
    raise AdapterError(f"{path}: tensor {key!r} is not a LoRA A/B weight of a linear layer "
                       "(embedding LoRA, biases and saved modules are not supported)")


def load_weights(spec: AdapterSpec, dtype: torch.dtype, device: torch.device) -> dict[str, LoraWeights]:
    """The adapter's weights per module, in `dtype` on `device` (read from `spec.src` again)."""
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(spec.src / ADAPTER_WEIGHTS), device=str(device))
    except Exception as exc:  # the folder changed or went away since it was registered
        raise AdapterError(f"{spec.src / ADAPTER_WEIGHTS}: {exc}") from None
    weights = {}
    for module in spec.targets:
        a = tensors[f"{_PREFIX}{module}.lora_A.weight"].to(dtype).contiguous()
        b = tensors[f"{_PREFIX}{module}.lora_B.weight"].to(dtype).contiguous()
        r = a.shape[0]
        scale = spec.alpha / (math.sqrt(r) if spec.use_rslora else r)
        weights[module] = LoraWeights(a, b, scale)
    return weights


class LoraRouter:
    """Which rows of the current forward use which adapter slot; the LoraLinear layers read `groups`."""

    def __init__(self) -> None:
        # (slot, row indices or None for every row), one entry per slot in the forward; empty: base only
        self.groups: list[tuple[int, list[int] | None]] = []
        self.batch = 0  # rows in the forward: a layer's input must be [batch, ...] to be split by row
        self.packed = False  # the forward's input is [1, batch, ...]: a packed sequence's tokens are its rows
        # The groups' index tensors by (slot, device), made once per forward on each device that asks:
        # under device_map=auto the layers live on several GPUs, and an index must be on its input's.
        self._indexes: dict[tuple[int, torch.device], torch.Tensor] = {}

    @contextmanager
    def rows(self, slots: Sequence[int | None], packed: bool = False) -> Iterator[None]:
        """Within the block, row i of every forward uses adapter slot `slots[i]` (None: the base model).
        `packed`: the forward is one packed sequence (engine/kv/mixed.py), and `slots` are its tokens'."""
        groups: dict[int, list[int]] = {}
        for i, slot in enumerate(slots):
            if slot is not None:
                groups.setdefault(slot, []).append(i)
        self.groups = [(slot, None if len(rows) == len(slots) else rows) for slot, rows in groups.items()]
        self.batch, self.packed = len(slots), packed
        try:
            yield
        finally:
            self.groups, self.batch, self.packed, self._indexes = [], 0, False, {}

    def index(self, slot: int, rows: list[int], device: torch.device) -> torch.Tensor:
        """`rows` (slot `slot`'s group) as an index tensor on `device`, the device of the input it indexes."""
        key = (slot, device)
        if key not in self._indexes:
            self._indexes[key] = torch.tensor(rows, dtype=torch.long, device=device)
        return self._indexes[key]


class LoraLinear(nn.Module):
    """A linear layer plus the LoRA deltas of the adapter slots its forward's rows use (module docstring)."""

    def __init__(self, base: nn.Module, router: LoraRouter):
        super().__init__()
        self.base = base
        self.router = router
        self.in_features, self.out_features = base.in_features, base.out_features
        self.slots: dict[int, LoraWeights] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        packed = bool(self.router.packed and self.router.groups) and x.dim() == 3 and x.shape[0] == 1
        if packed:  # one packed sequence (engine/kv/mixed.py): each token is a row, as [tokens, 1, features]
            x, out = x.transpose(0, 1), out.transpose(0, 1)
        for slot, rows in self.router.groups:
            weights = self.slots.get(slot)
            if weights is None:  # this adapter leaves this layer alone
                continue
            if rows is not None and x.shape[0] != self.router.batch:  # e.g. a model that flattens rows first
                raise RuntimeError(f"LoRA: a layer's input of shape {tuple(x.shape)} is not split by the batch's "
                                   f"{self.router.batch} rows, so rows of different adapters cannot share it")
            if rows is not None:
                rows = self.router.index(slot, rows, x.device)
            part = x if rows is None else x.index_select(0, rows)
            delta = weights.up(weights.down(part.to(weights.a.dtype)))
            delta = (delta * weights.scale).to(out.dtype)
            if rows is None:
                out = out + delta
            else:
                out = out.index_add(0, rows, delta)
        return out.transpose(0, 1) if packed else out


def _adaptable(module: nn.Module) -> bool:
    """A plain fp32/fp16/bf16 linear layer or its oneDNN-packed form (not a quantized one)."""
    return type(module) is nn.Linear or on_onednn(module)


class LoraModel:
    """The served model with LoraLinear layers in place, and the adapter slots installed in them."""

    def __init__(self, model: nn.Module, router: LoraRouter, layers: dict[str, LoraLinear]):
        self.model, self.router, self.layers = model, router, layers

    @classmethod
    def wrap(cls, model: nn.Module) -> "LoraModel":
        """Put a LoraLinear around every adaptable linear layer but the output head, in place."""
        router = LoraRouter()
        head = model.get_output_embeddings()
        layers = {}
        for name, module in list(model.named_modules()):
            if module is head or not _adaptable(module):
                continue
            layer = LoraLinear(module, router)
            replace_module(model, name, layer)
            layers[name] = layer
        model.lmi_lora = router  # what the engine's forwards find (engine/adapters.py: lora_rows)
        return cls(model, router, layers)

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        """module name -> (in, out) features, for `read_adapter`."""
        return {name: (layer.in_features, layer.out_features) for name, layer in self.layers.items()}

    def install(self, slot: int, weights: dict[str, LoraWeights]) -> None:
        """Make `slot` the adapter `weights` (replacing what it was)."""
        for name, layer in self.layers.items():
            if name in weights:
                layer.slots[slot] = weights[name].on_kernel_of(layer.base)
            else:
                layer.slots.pop(slot, None)

    def remove(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.slots.pop(slot, None)


def router_of(model: nn.Module) -> LoraRouter | None:
    """The router `LoraModel.wrap` gave `model`, or None when LoRA is off."""
    return getattr(model, "lmi_lora", None)
