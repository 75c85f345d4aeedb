"""DJL's adapters management API on a model's LoRA adapters (engine/adapters.py): the routes' logic.

POST   /models/{m}/adapters?name=&src=[&preload=&pin=]   register      {"status": "Adapter a1 registered"}
GET    /models/{m}/adapters[?limit=&next_page_token=]     list          {"adapters": [...], "nextPageToken"?}
GET    /models/{m}/adapters/{a}                           describe      [{"name", "src", "pin", ...}]
POST   /models/{m}/adapters/{a}/update[?src=&preload=&pin=]  update     {"status": "Adapter a1 updated"}
DELETE /models/{m}/adapters/{a}                           unregister    {"status": "Adapter a1 unregistered"}

Errors in LMI's management shape (errors.py): 404 an unknown model or adapter, 400 a folder that is
no adapter this model can serve (or a rank over option.max_lora_rank, or an unknown argument), 403 a
`src` outside the adapters root (engine.adapters.check_source; the route renders SourceRefused), 409 a
name already registered. The routes that change adapters are management routes (security.py): off
unless option.enable_management_api. An update re-reads the folder (`src`, by default the one registered)
as a new version under the same name: requests already running finish on the old one.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lmi_serve import echo
from lmi_serve.engine.adapters import (
    Adapter, AdapterExists, Adapters, SourceRefused, check_source, model_adapters_folder,
)
from lmi_serve.errors import InvalidRequest
from lmi_serve.model.lora import AdapterError
from lmi_serve.serving.service import ModelService

_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")
_REGISTER_ARGS = {"name", "src", "preload", "pin"}
_UPDATE_ARGS = {"src", "preload", "pin"}


def adapters_of(service: ModelService) -> Adapters:
    """The model's adapters; InvalidRequest when it serves none (LoRA off, or not a rolling-batch model)."""
    service.require_ready()
    adapters = getattr(service.engine, "adapters", None)
    if adapters is None:
        raise InvalidRequest(f"Model {service.name} serves no LoRA adapters (option.enable_lora is false)")
    return adapters


def _flag(args: Mapping[str, str], name: str, default: bool) -> bool:
    value = args.get(name)
    if value is None or value == "":
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise InvalidRequest(f"{name} must be true or false, not {value!r}", param=name)


def _check_args(args: Mapping[str, str], allowed: set[str]) -> None:
    unknown = echo.unknown(args, allowed)
    if unknown:
        raise InvalidRequest(f"Unsupported argument(s) {echo.names(unknown)}; this API takes {sorted(allowed)}")


def source_root(service: ModelService, adapters_root: str | None) -> Path | None:
    """The folder this model's adapters may be registered from: option.adapters_root, else the
    model's own adapters/ folder (None for a model from the hub: then none may be)."""
    if adapters_root:
        return Path(adapters_root)
    return model_adapters_folder(service.config.model_dir, service.config.model_id)


def _checked(src: str, root: Path | None) -> Path:
    """check_source: SourceRefused goes up (403 at the route), any other AdapterError is a 400."""
    try:
        return check_source(src, root)
    except SourceRefused:
        raise
    except AdapterError as exc:
        raise InvalidRequest(str(exc), param="src") from None


def register(adapters: Adapters, args: Mapping[str, str], root: Path | None) -> tuple[int, dict[str, Any]]:
    """POST /models/{m}/adapters: (status, body). AdapterExists (409 at the route) for a taken name,
    SourceRefused (403) for a `src` outside `root`."""
    _check_args(args, _REGISTER_ARGS)
    name, src = args.get("name"), args.get("src")
    if not name or not src:
        raise InvalidRequest("Both name and src are required (POST /models/{model}/adapters?name=...&src=...)")
    folder = _checked(src, root)
    try:
        adapters.register(name, folder, preload=_flag(args, "preload", True), pin=_flag(args, "pin", False))
    except AdapterExists:
        raise
    except AdapterError as exc:
        raise InvalidRequest(str(exc)) from None
    return 200, {"status": f"Adapter {name} registered"}


def update(adapters: Adapters, name: str, args: Mapping[str, str], root: Path | None) -> dict[str, Any]:
    """POST /models/{m}/adapters/{a}/update: a new version from `src` (default: the same folder,
    which was checked when it was registered); SourceRefused (403) for a `src` outside `root`."""
    _check_args(args, _UPDATE_ARGS)
    current = adapters.get(name)  # NotFound: 404
    folder = _checked(args["src"], root) if args.get("src") else current.spec.src
    try:
        adapters.register(name, folder, replace=True,
                          preload=_flag(args, "preload", True), pin=_flag(args, "pin", current.pinned))
    except AdapterError as exc:
        raise InvalidRequest(str(exc)) from None
    return {"status": f"Adapter {name} updated"}


def listing(adapters: Adapters, args: Mapping[str, str]) -> dict[str, Any]:
    """GET /models/{m}/adapters, paginated as DJL's lists are (`limit`, `next_page_token`)."""
    _check_args(args, {"limit", "next_page_token"})
    try:
        limit = int(args.get("limit") or 100)
        start = int(args.get("next_page_token") or 0)
    except ValueError:
        raise InvalidRequest("limit and next_page_token must be integers") from None
    if limit < 1 or start < 0:
        raise InvalidRequest("limit must be >= 1 and next_page_token >= 0")
    every = adapters.list()
    body: dict[str, Any] = {"adapters": [describe(a) for a in every[start:start + limit]]}
    if start + limit < len(every):
        body["nextPageToken"] = str(start + limit)
    return body


def describe(adapter: Adapter) -> dict[str, Any]:
    return adapter.describe()
