"""Which served model a request's `model` field selects, and the chat service over it.

OpenAI's rules (docs/openai.md, "Model names"), which the Anthropic dialect follows too, since its
clients name models the same way: `model` picks among the served models or names a registered LoRA
adapter of one (vLLM's convention); without it, the first model of the route's task; an unknown name
selects the only text-generation model, as TGI does (unless `LMI_SERVE_STRICT_MODEL_NAMES`, or LoRA
adapters are served), else a 404 listing the served names. Needs a Flask app context (the registry
is the app's).
"""

from __future__ import annotations

from collections.abc import Mapping

from flask import current_app

from lmi_serve.dialects.openai.reasoning import reasoning_settings
from lmi_serve.dialects.openai.service import OpenAIService
from lmi_serve.dialects.openai.templates import trusts_request_template
from lmi_serve.errors import InvalidRequest, NotFound
from lmi_serve.serving.registry import ModelRegistry
from lmi_serve.serving.service import ModelService

GENERATION_TASK, EMBEDDING_TASK = "text-generation", "text-embedding"


def registry() -> ModelRegistry:
    return current_app.extensions["lmi_serve.serving.registry"]


def _serves(service: ModelService, task: str) -> bool:
    return service.generates_text if task == GENERATION_TASK else service.task == task


def choose_service(services: Mapping[str, ModelService], name: str | None, task: str, *,
                   strict: bool) -> ModelService:
    """The model a request's `model` field selects for a route of `task` (docs/openai.md, "Model names"):
    - a served name selects that model (of another task: 400);
    - no name: the first model of the task;
    - an unknown name, when exactly one text-generation model is served and `strict` is off: that
      model (TGI serves one model and reads no name; clients built on a base URL send `dummy`);
      otherwise a 404 listing the names of the task's models."""
    if name and name in services:
        service = services[name]
        if not _serves(service, task):
            raise InvalidRequest(f"The model `{name}` serves {service.task}, not {task}", param="model")
        return service
    candidates = [s for s in services.values() if _serves(s, task)]
    if not name and candidates:
        return candidates[0]
    if not name:
        raise NotFound(f"No {task} model is served", param="model")
    if not strict and task == GENERATION_TASK and len(candidates) == 1:
        return candidates[0]
    served = ", ".join(f"`{s.name}`" for s in candidates) or "none"
    raise NotFound(f"The model `{name}` does not exist; {task} models served: {served}", param="model")


def ready_service(name: str | None, task: str) -> ModelService:
    """The served model `name` selects for `task`, ready to answer (else NotReady)."""
    # With LoRA adapters served, `model` names an adapter or a model: an unknown name is a 404, never the base.
    strict = current_app.config.get("STRICT_MODEL_NAMES", False) or (
        task == GENERATION_TASK and any(adapters_of(s) is not None for s in registry().services.values()))
    service = choose_service(registry().services, name, task, strict=strict)
    service.require_ready()
    return service


def adapters_of(service: ModelService):
    """The service's LoRA adapters (engine/adapters.py), or None when it serves none."""
    return getattr(getattr(service, "engine", None), "adapters", None)


def adapter_owner(name: str | None) -> ModelService | None:
    """The model whose registered LoRA adapter `name` is (vLLM's convention: `model` names the adapter),
    or None when `name` is a model's name or no adapter's."""
    services = registry().services
    if not name or name in services:
        return None
    return next((s for s in services.values() if (adapters := adapters_of(s)) is not None and name in adapters),
                None)


def generation_target(name: str | None) -> tuple[ModelService, str | None]:
    """(the text-generation model `name` selects, the LoRA adapter it names or None), ready to serve."""
    owner = adapter_owner(name)
    if owner is not None:
        owner.require_ready()
        return owner, name
    return ready_service(name, GENERATION_TASK), None


def openai_service(service: ModelService, adapter: str | None = None,
                   route: str = "the OpenAI routes") -> OpenAIService:
    """The chat and completions service over `service`'s engine (as `adapter`, when one is named); `route`
    names the routes in the 400 of a model served without a rolling batch."""
    return OpenAIService(service.rolling_engine(route, param="model"), service.name, adapter=adapter,
                         reasoning=reasoning_settings(getattr(service, "config", None)),
                         tool_call_parser=getattr(getattr(service, "config", None), "tool_call_parser", None),
                         vision=getattr(service, "vision", None),
                         trust_request_template=trusts_request_template(service))


def chat_service(name: str | None, route: str = "the OpenAI routes") -> OpenAIService:
    """The chat and completions service over the model (or LoRA adapter) `name` selects."""
    service, adapter = generation_target(name)
    return openai_service(service, adapter, route)
