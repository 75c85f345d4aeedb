"""The models one worker serves, and which of them a request means."""

from __future__ import annotations

import threading
from collections.abc import Callable

from lmi_serve.config.sources import ServerConfig
from lmi_serve.errors import InvalidRequest, NotFound
from lmi_serve.serving import heap
from lmi_serve.serving.service import ModelService, ModelStatus


class ModelRegistry:
    def __init__(self, services: list[ModelService]):
        # Replaced whole, never changed in place, when a model is added or removed at run time
        # (multi_model.py): a route iterating the old dict meanwhile is not disturbed.
        self.services = {s.name: s for s in services}
        self.stopping = False  # set by a SIGTERM (drain.py): the health routes answer unhealthy from then on
        self._lock = threading.Lock()

    def add(self, service: ModelService) -> None:
        """Serve `service` from now on (a model loaded at run time); its name must be free."""
        with self._lock:
            if service.name in self.services:
                raise ValueError(f"model {service.name} is already served")
            self.services = {**self.services, service.name: service}

    def remove(self, name: str) -> ModelService:
        """Stop listing `name` (NotFound if it is not): new requests no longer reach it."""
        with self._lock:
            if name not in self.services:
                raise NotFound(f"Model not found: {name}")
            service = self.services[name]
            self.services = {k: v for k, v in self.services.items() if k != name}
            return service

    @classmethod
    def from_config(cls, config: ServerConfig,
                    observer_for: Callable[[str], object] | None = None) -> "ModelRegistry":
        """`observer_for(name)`: each model's observer (service.ModelObserver), if any."""
        return cls([ModelService(m, config.cache_dir, observer_for(m.name) if observer_for else None)
                    for m in config.models])

    def start_loading(self) -> None:
        """Load the models one after another on a background thread: in parallel they would only
        fight over the same cores (and race in transformers' lazy imports)."""
        def load_all() -> None:
            for service in self.services.values():
                service.load()
            heap.settle()  # what loading made lives as long as the worker: out of the collector's walks

        threading.Thread(target=load_all, name="model-loader", daemon=True).start()

    def get(self, name: str) -> ModelService:
        try:
            service = self.services[name]
        except KeyError:
            raise NotFound(f"Model not found: {name}") from None
        service.requested()
        return service

    def for_invocations(self, model_name: str | None) -> ModelService:
        """The model `model_name` names; else the only model; else the first text-generation
        model in configuration order (the model store's folders sorted by name)."""
        if model_name:
            return self.get(model_name)
        if len(self.services) == 1:
            return next(iter(self.services.values()))
        for service in self.services.values():
            if service.generates_text:
                return service
        raise InvalidRequest("Parameter model_name is required.")

    def health(self) -> tuple[ModelStatus, dict]:
        """(overall status, per-model body) for the health routes: STOPPING once the server is
        shutting down, else FAILED if any model failed, else LOADING if any is still loading, else READY."""
        if self.stopping:
            return ModelStatus.STOPPING, {name: {"status": ModelStatus.STOPPING.value} for name in self.services}
        statuses = {name: s.current_status() for name, s in self.services.items()}
        body = {}
        for name, status in statuses.items():
            body[name] = {"status": status.value}
            if status is ModelStatus.FAILED:
                body[name]["error"] = self.services[name].error
        for overall in (ModelStatus.FAILED, ModelStatus.LOADING):
            if overall in statuses.values():
                return overall, body
        return ModelStatus.READY, body
