"""The engine's LoRA adapters: the registered ones by name, and which of them are resident in a slot.

Registered adapters are unbounded; at most `max_loras` are resident (their weights installed in the
model's LoraLinear layers, model/lora.py), each in a slot. A request names its adapter; `submit`
leases it (`Adapter.users`: waiting or running requests), and the scheduler, when it admits the
request, asks `acquire` for the adapter's slot: the one it has, else a free one, else the slot of
the least recently used adapter no running row uses (evicted: its weights are dropped and read
from its folder again when a request needs it). With every slot used by running rows the request
waits at the head of the queue until a row finishes. A finished request returns its lease
(`release`).

Unregistering removes the name at once (new requests for it are refused) and drops the weights
once no request uses them any more. Registration reads and checks the folder on the caller's
thread; installing the weights into a slot no row uses is a few dict assignments, safe between
or during the scheduler's forwards (a forward reads only the slots of its own rows).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmi_serve.engine.kv.select import is_encoder_decoder
from lmi_serve.errors import InvalidRequest, NotFound
from lmi_serve.model.lora import (
    ADAPTER_CONFIG, ADAPTER_WEIGHTS, LORA_DTYPES, AdapterError, AdapterSpec, LoraModel, load_weights, read_adapter,
    router_of,
)

log = logging.getLogger(__name__)


class AdapterExists(InvalidRequest):
    """Registering a name that is taken."""


@dataclass(eq=False)
class Adapter:
    """One registered adapter. `users`: requests submitted and not finished; `rows`: those admitted."""

    name: str
    spec: AdapterSpec
    registered_at: float = field(default_factory=time.time)
    slot: int | None = None
    weights: dict | None = field(default=None, repr=False)
    last_used: int = 0
    users: int = 0
    rows: int = 0
    requests: int = 0  # requests served since registration
    loads: int = 0  # times its weights were read (1 + reloads after eviction)
    pinned: bool = False  # never evicted to make room for another
    removed: bool = False

    @property
    def resident(self) -> bool:
        return self.slot is not None

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "src": str(self.spec.src), "pin": self.pinned, "rank": self.spec.rank,
                "alpha": self.spec.alpha,
                "targetModules": sorted({t.rsplit(".", 1)[-1] for t in self.spec.targets}),
                "baseModel": self.spec.base_model, "resident": self.resident, "slot": self.slot,
                "activeRequests": self.users, "requests": self.requests, "loads": self.loads}


def model_adapters_folder(model_dir: str | None, model_id: str | None) -> Path | None:
    """`<model dir>/adapters`: the model dir, else a local model_id folder; None for a hub id. The
    folder registered at start-up, and the default root of the adapters API."""
    root = model_dir or (model_id if model_id and Path(model_id).is_dir() else None)
    return Path(root) / "adapters" if root else None


class SourceRefused(AdapterError):
    """A `src` outside the allowed root (after resolving `..` and symlinks): the caller may not
    make the server read it (403 at the route, where AdapterError is a 400)."""


# Weights saved with pickle (torch.save): loading one can run code, so they are never read.
PICKLE_WEIGHTS = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth", "adapter_model.ckpt")


def check_source(src: str, root: Path | None) -> Path:
    """Check an adapter's `src` given through the API against `root`, before anything reads it; the
    folder to read (resolved). A relative `src` is taken inside `root`. SourceRefused when it, or its
    config or weights file, resolves (after `..` and symlinks) outside `root`, or when there is no
    root; AdapterError when it is not a folder or holds pickled weights only."""
    if root is None:
        raise SourceRefused("no folder may be registered through the API: this model has no model dir whose "
                            "adapters/ folder could be the root; set option.adapters_root")
    if not src or "\x00" in src:
        raise AdapterError("src must be a folder path")
    try:  # a symlink loop, a name too long for the filesystem: the client's path, a 400
        return _confined(src, root.resolve())
    except (OSError, RuntimeError) as exc:
        raise AdapterError(f"src {src!r} cannot be resolved: {exc}") from None


def _confined(src: str, root: Path) -> Path:
    requested = Path(src) if Path(src).is_absolute() else root / src
    folder = requested.resolve()
    if not folder.is_relative_to(root):
        raise SourceRefused(f"src {src!r} resolves to {folder}, outside the adapters root {root} "
                            "(option.adapters_root); '..' and symlinks leading out of it are refused")
    if not folder.is_dir():
        raise AdapterError(f"src {src!r} is not a folder inside the adapters root {root}")
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        target = (folder / name).resolve()
        if (folder / name).exists() and not target.is_relative_to(root):
            raise SourceRefused(f"src {src!r}: {name} is a link to {target}, outside the adapters root {root}")
    if not (folder / ADAPTER_WEIGHTS).exists():
        pickled = [name for name in PICKLE_WEIGHTS if (folder / name).exists()]
        if pickled:
            raise AdapterError(f"src {src!r} holds {pickled[0]}, pickled weights, which are never loaded (loading "
                               f"one can run code); save the adapter as {ADAPTER_WEIGHTS} (PEFT's "
                               "save_pretrained(safe_serialization=True), the default)")
    return folder


class Adapters:
    """Thread-safe: request threads look up and lease, API threads register and unregister, the
    scheduler thread acquires slots."""

    def __init__(self, lora: LoraModel, *, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device):
        self.lora, self.max_loras, self.max_rank = lora, max_loras, max_rank
        self.dtype, self.device = dtype, device
        self._by_name: dict[str, Adapter] = {}
        self._slots: list[Adapter | None] = [None] * max_loras
        self._clock = itertools.count(1)
        self._lock = threading.RLock()

    # -- registration (API and start-up threads) ------------------------------------------
    def register(self, name: str, src: str | Path, *, replace: bool = False, preload: bool = True,
                 pin: bool = False) -> Adapter:
        """Check and register the folder `src` as `name`; with `preload`, resident at once when a slot
        is free or idle (else when a request needs it); `pin`: never evicted. AdapterExists for a
        taken name (unless `replace`: then the old one is unregistered, running requests finishing
        on it); AdapterError (a ValueError) for a folder this model cannot serve or a pin that would
        leave no slot to the others. `src` is read as given: a folder from a caller goes through
        `check_source` first."""
        if not name or "/" in name:
            raise AdapterError(f"adapter name {name!r} must be non-empty and hold no '/'")
        spec = read_adapter(src, self.lora.shapes, self.max_rank)
        weights = load_weights(spec, self.dtype, self.device) if preload or pin else None
        with self._lock:
            old = self._by_name.get(name)
            if old is not None and not replace:
                raise AdapterExists(f"Adapter {name} is already registered")
            pinned = sum(a.pinned for a in self._by_name.values() if a is not old)
            if pin and pinned + 1 >= self.max_loras:
                raise AdapterError(f"pinning {name} would pin {pinned + 1} of option.max_loras={self.max_loras} "
                                   "slots, leaving none for the other adapters")
            if old is not None:
                self._unregister(old)
            adapter = Adapter(name, spec, loads=int(weights is not None), pinned=pin)
            self._by_name[name] = adapter
            slot = self._free_slot() if weights is not None else None
            if slot is not None:
                self._install(adapter, slot, weights)
            return adapter

    def unregister(self, name: str) -> Adapter:
        """Remove `name` now; its weights go once no request uses it. NotFound when not registered."""
        with self._lock:
            adapter = self.get(name)
            self._unregister(adapter)
            return adapter

    def _unregister(self, adapter: Adapter) -> None:
        adapter.removed = True
        del self._by_name[adapter.name]
        if adapter.users == 0:
            self._evict(adapter)

    # -- lookups (any thread) --------------------------------------------------------------
    def get(self, name: str) -> Adapter:
        with self._lock:
            adapter = self._by_name.get(name)
        if adapter is None:
            raise NotFound(f"Adapter {name} is not registered", param="adapter")
        return adapter

    def list(self) -> list[Adapter]:
        with self._lock:
            return sorted(self._by_name.values(), key=lambda a: a.name)

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._by_name

    # -- requests --------------------------------------------------------------------------
    def lease(self, name: str) -> Adapter:
        """A request for `name` is submitted: keep the adapter until `release`. NotFound if unknown."""
        with self._lock:
            adapter = self.get(name)
            adapter.users += 1
            adapter.requests += 1
            return adapter

    def release(self, adapter: Adapter, admitted: bool) -> None:
        """A leased request finished (`admitted`: it held a row)."""
        with self._lock:
            adapter.users -= 1
            if admitted:
                adapter.rows -= 1
            if adapter.removed and adapter.users == 0:
                self._evict(adapter)

    def acquire(self, adapter: Adapter) -> int | None:
        """The scheduler admits a request of `adapter`: its slot, made resident if it was not (its
        weights read again), or None when every slot holds an adapter that running rows use. Raises
        AdapterError when the folder can no longer be read."""
        with self._lock:
            if adapter.slot is None:
                slot = self._free_slot()
                if slot is None:
                    return None
                self._install(adapter, slot, load_weights(adapter.spec, self.dtype, self.device))
                adapter.loads += 1
            adapter.rows += 1
            adapter.last_used = next(self._clock)
            return adapter.slot

    # -- slots (under the lock) --------------------------------------------------------------
    def _free_slot(self) -> int | None:
        """An empty slot, else the slot of the least recently used adapter without running rows
        (evicted now), else None."""
        for slot, holder in enumerate(self._slots):
            if holder is None:
                return slot
        idle = [a for a in self._slots if a is not None and a.rows == 0 and not a.pinned]
        if not idle:
            return None
        victim = min(idle, key=lambda a: a.last_used)
        slot = victim.slot
        self._evict(victim)
        return slot

    def _install(self, adapter: Adapter, slot: int, weights: dict) -> None:
        self.lora.install(slot, weights)
        self._slots[slot] = adapter
        adapter.slot, adapter.weights = slot, weights
        adapter.last_used = next(self._clock)

    def _evict(self, adapter: Adapter) -> None:
        if adapter.slot is None:
            return
        self.lora.remove(adapter.slot)
        self._slots[adapter.slot] = None
        adapter.slot, adapter.weights = None, None


@contextmanager
def lora_rows(model: Any, slots: Sequence[int | None], packed: bool = False) -> Iterator[None]:
    """Within the block, the model's forwards run row i with adapter slot `slots[i]` (None: the base
    model); nothing when the model has no LoRA layers or no row has an adapter. Each layer indexes
    its rows on its own input's device (model/lora.py: `LoraRouter.index`). `packed`: the forward is one
    packed sequence (kv/mixed.py) and `slots` are its tokens' (a row's slot once per token it feeds)."""
    router = router_of(model)
    if router is None or all(slot is None for slot in slots):
        with nullcontext():
            yield
        return
    with router.rows(slots, packed=packed):
        yield


def start_adapters(model: Any, device: torch.device, *, max_loras: int, max_rank: int, dtype: str,
                   folder: Path | None) -> Adapters:
    """Wrap `model` for LoRA (model/lora.py) and register every PEFT adapter sub-folder of `folder`
    under its folder's name. `dtype`: the LoRA matrices' (auto: the model's). A folder that is not an
    adapter this model can serve fails the start-up, naming it."""
    if is_encoder_decoder(model):
        raise ValueError("option.enable_lora: LoRA adapters are served on decoder-only models; this model is an "
                         "encoder-decoder model")
    model_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    adapters = Adapters(LoraModel.wrap(model), max_loras=max_loras, max_rank=max_rank,
                        dtype=LORA_DTYPES.get(dtype, model_dtype), device=device)
    if folder is not None and folder.is_dir():
        for sub in sorted(p for p in folder.iterdir() if p.is_dir() and (p / ADAPTER_CONFIG).is_file()):
            try:
                adapters.register(sub.name, str(sub))
            except AdapterError as exc:
                raise ValueError(f"option.enable_lora: adapter folder {sub}: {exc}") from None
    log.info("LoRA adapters on: %d registered from %s (%d resident at most, rank <= %d)", len(adapters.list()),
             folder, max_loras, max_rank)
    return adapters
