"""Models loaded and unloaded at run time: SageMaker multi-model endpoints (POST / DELETE /models) and
DJL's register API, on one machinery.

- **Load** (`load`): the folder must lie inside `model_url_root` (SageMaker copies each model to
  /opt/ml/models/<id>/model); its configuration is read as at start-up (its serving.properties over the
  OPTION_* environment); the memory budget (memory_budget.py) must hold its estimate, else
  OutOfResources (507: SageMaker then unloads the least used models and retries); then it loads on the
  caller's thread, one load at a time (in parallel, loads would only fight over the same cores and race
  in transformers' lazy imports), bounded by its model_loading_timeout. A model that fails to load is
  that request's error (400, naming the folder and why) and is not kept: /ping stays healthy.
- **Unload** (`unload`): the name leaves the registry first (new requests get the dialect's 404), the
  requests in flight get `grace` seconds to finish, the rest end with NotReady, the model's threads
  stop, and the memory goes back (gc, frozen objects included: heap.py; then glibc's malloc_trim).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from lmi_serve.config.sources import ConfigError, ModelConfig, ServerConfig, load_model_config
from lmi_serve.engine.memory import trim
from lmi_serve.model.source import resolve_model_source
from lmi_serve.errors import AlreadyExists, Forbidden, InvalidRequest, OutOfResources
from lmi_serve.serving import heap
from lmi_serve.serving.memory_budget import LIMIT_SHARE, MemoryBudget, container_memory, kv_bytes, weights_bytes
from lmi_serve.serving.registry import ModelRegistry
from lmi_serve.serving.service import ModelService, ModelStatus

log = logging.getLogger(__name__)

_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


class ModelLoader:
    def __init__(self, registry: ModelRegistry, config: ServerConfig,
                 make_service: Callable[[ModelConfig], ModelService], env: dict[str, str]):
        """`make_service(config)`: a ModelService wired as the start-up ones are (observer, on_request);
        `env`: the environment the models' OPTION_* come from."""
        self.registry, self.config, self.make_service, self.env = registry, config, make_service, env
        self.budget = MemoryBudget(config.mme_memory_limit or int(LIMIT_SHARE * container_memory()))
        self.urls: dict[str, str] = {}  # name -> the url it was loaded from, as given
        self.loaded_at_startup = set(registry.services)
        self._load_lock = threading.Lock()  # one load at a time
        self._names_lock = threading.Lock()  # the names loaded or being loaded
        self._pending: set[str] = set()
        self._startup_counted = False

    def _count_startup_models(self) -> None:
        """The models served from start-up hold their share of the limit too (counted at the first
        load, not at start: an estimate reads every weight file's header)."""
        if not self._startup_counted:
            self._startup_counted = True
            for name in self.loaded_at_startup:
                service = self.registry.services.get(name)
                if service is not None:
                    self.budget.hold(name, estimate(service.config) + kernel_copies(service))

    def load(self, name: str, url: str) -> ModelService:
        """Load the model in folder `url` as `name` and serve it; raises the kind the dialect renders."""
        if not name or not set(name) <= _NAME_CHARS or name in (".", ".."):
            raise InvalidRequest(f"model_name {name!r} must be letters, digits, '_', '.' or '-'", param="model_name")
        folder = self._folder(url)
        with self._names_lock:
            if name in self.registry.services or name in self._pending:
                raise AlreadyExists(f"Model {name} is already loaded")
            self._pending.add(name)
        try:
            return self._load(name, url, folder)
        finally:
            self._pending.discard(name)

    def _load(self, name: str, url: str, folder: Path) -> ModelService:
        try:
            model_config = load_model_config(folder, self.env, name=name, one_of_many=True)
        except ConfigError as exc:
            raise InvalidRequest(f"Model {name}: {exc}", param="url") from None
        self._count_startup_models()
        refusal = self.budget.reserve(name, estimate(model_config))
        if refusal is not None:
            raise OutOfResources(refusal.message(name))
        try:
            with self._load_lock:
                started = time.monotonic()
                service = self.make_service(model_config)
                service.load()
            if service.current_status() is not ModelStatus.READY:
                error = service.error
                service.unload(0)
                # the folder's content is what failed: the caller's to fix, retrying fails alike
                raise InvalidRequest(f"Model {name} failed to load from {url}: {error}", param="url")
        except BaseException:
            self.budget.release(name)
            _give_memory_back()
            raise
        self.budget.hold(name, self.budget.held(name) + kernel_copies(service))  # now that they are known
        self.registry.add(service)
        self.urls[name] = url
        heap.settle()
        log.info("Model %s loaded from %s in %.1f s (budget: %d of %d MiB held)", name, url,
                 time.monotonic() - started, self.budget.in_use >> 20, self.budget.limit >> 20)
        return service

    def unload(self, name: str, grace: float) -> None:
        """Stop serving `name` (NotFound if it is not served) and give its memory back."""
        service = self.registry.remove(name)
        started = time.monotonic()
        service.unload(grace)
        self.budget.release(name)
        self.urls.pop(name, None)
        del service
        _give_memory_back()
        log.info("Model %s unloaded in %.1f s", name, time.monotonic() - started)

    def url_of(self, service: ModelService) -> str | None:
        return self.urls.get(service.name) or service.config.model_dir or service.config.model_id

    def _folder(self, url: str) -> Path:
        """`url` resolved inside model_url_root (after `..` and symlinks), a folder; else the refusal."""
        if not isinstance(url, str) or not url or "\x00" in url or "://" in url:
            raise InvalidRequest(f"url {url!r} must be a local folder (a path, not a URL)", param="url")
        root = Path(self.config.model_url_root).resolve()
        try:
            folder = (Path(url) if Path(url).is_absolute() else root / url).resolve()
        except (OSError, RuntimeError) as exc:
            raise InvalidRequest(f"url {url!r} cannot be resolved: {exc}", param="url") from None
        if not folder.is_relative_to(root):
            raise Forbidden(f"url {url!r} resolves to {folder}, outside the models root {root} "
                            "(option.model_url_root); '..' and symlinks leading out of it are refused")
        if not folder.is_dir():
            raise InvalidRequest(f"url {url!r} is not a folder inside the models root {root}", param="url")
        return folder


def estimate(config: ModelConfig) -> int:
    """The bytes `config`'s model will take (memory_budget.py): its folder's weights, and where
    model_id is another local folder, that one's too, plus a generation model's K/V allowance."""
    sources = [config.model_dir]
    if config.model_id:
        try:
            sources.append(resolve_model_source(config.model_id))  # package:, else the id itself
        except Exception:  # noqa: BLE001 - a source that does not resolve fails the load itself, with its message
            pass
    folders = [Path(p) for p in sources if p and Path(p).is_dir()]
    dtype = str(config.dtype or "auto")
    total = weights_bytes(folders, dtype)
    if (config.task or "text-generation") in ("text-generation", "text2text-generation"):
        total += max((kv_bytes(f / "config.json", config.max_rolling_batch_size, dtype) for f in folders), default=0)
    return total


def kernel_copies(service: ModelService) -> int:
    """The bytes a loaded model holds beyond its weights at the load dtype: the row kernel's copies
    (kernels/footprint.py), which the estimate before loading cannot know (they depend on the host)."""
    footprint = getattr(getattr(service, "kernels", None), "memory", None)  # a handler without a plan: none
    return footprint.row_copies if footprint is not None else 0


def _give_memory_back() -> None:
    """Collect what the model left in reference cycles (frozen ones too), then hand glibc's freed pages to the OS."""
    heap.collect()
    trim()
