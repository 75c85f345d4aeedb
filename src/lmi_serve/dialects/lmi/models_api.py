"""The model-management routes' shapes: SageMaker's multi-model contract and DJL's register API, over
serving/multi_model.py's ModelLoader (routes.py declares the routes).

SageMaker (docs.aws.amazon.com/sagemaker/latest/dg/mms-container-apis.html), with SAGEMAKER_MULTI_MODEL:
- `POST /models` `{"model_name", "url"}`: load; 409 when the name is loaded, 507 when it would not fit
- `GET /models[?next_page_token=&limit=]`: `{"models": [{"modelName", "modelUrl"}...], "nextPageToken"}`
- `GET /models/<m>`: `{"modelName", "modelUrl"}`; `DELETE /models/<m>`: unload
- `POST /models/<m>/invoke`: /invocations for that model (X-Amzn-SageMaker-Target-Model is logged)
DJL's register API (without SAGEMAKER_MULTI_MODEL, a management route): `POST /models?url=&model_name=`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from flask import current_app, request

from lmi_serve import echo
from lmi_serve.json_body import loads
from lmi_serve.errors import InvalidRequest
from lmi_serve.serving.multi_model import ModelLoader
from lmi_serve.serving.service import ModelService

#: models per page of GET /models when the request gives no `limit` (DJL's default)
DEFAULT_PAGE = 100
MAX_PAGE = 1000


def loader() -> ModelLoader:
    return current_app.extensions["lmi_serve.serving.loader"]


def multi_model() -> bool:
    return loader().config.multi_model


def load_request(body: bytes, args: Mapping[str, str]) -> tuple[str, str]:
    """(model_name, url) of a load: SageMaker's JSON body in multi-model mode, DJL's query otherwise."""
    if multi_model():
        if args.get("url"):
            raise InvalidRequest("In multi-model mode (SAGEMAKER_MULTI_MODEL) POST /models takes SageMaker's JSON "
                                 'body {"model_name": ..., "url": ...}, not query parameters', param="url")
        payload = loads(body)
        if not isinstance(payload, dict):
            raise InvalidRequest('The body must be a JSON object {"model_name": ..., "url": ...}')
        unknown = echo.unknown(payload, {"model_name", "url"})
        if unknown:
            raise InvalidRequest(f"Unsupported field(s) {echo.names(unknown)}: the body has model_name and url",
                                 param=echo.first(unknown))
        name, url = payload.get("model_name"), payload.get("url")
    else:
        url = args.get("url")
        name = args.get("model_name") or (url.rstrip("/").rsplit("/", 1)[-1] if url else None)
        unknown = echo.unknown(args, {"url", "model_name", "synchronous"})
        if unknown:  # DJL's engine, batch_size, job_queue_size...: set them in the folder's serving.properties
            raise InvalidRequest(f"Unsupported parameter(s) {echo.names(unknown)}: put a model's options in its "
                                 "folder's serving.properties", param=echo.first(unknown))
        if args.get("synchronous", "true").lower() != "true":
            raise InvalidRequest("synchronous=false is not supported: the call returns once the model is loaded",
                                 param="synchronous")
    for field, value in (("model_name", name), ("url", url)):
        if not isinstance(value, str) or not value:
            raise InvalidRequest(f"{field} is required (a non-empty string)", param=field)
    return name, url


def entry(service: ModelService) -> dict:
    """One model in SageMaker's list shape, with DJL's status beside it."""
    return {"modelName": service.name, "modelUrl": loader().url_of(service),
            "status": service.current_status().value}


def page(services: list[ModelService], args: Mapping[str, str]) -> dict:
    """A page of GET /models: `limit` models from the offset `next_page_token` (an opaque token to the
    caller; here the offset, as DJL's), and the next page's token while more remain."""
    try:
        limit = int(args.get("limit", DEFAULT_PAGE))
        start = int(args.get("next_page_token") or args.get("nextPageToken") or 0)
    except ValueError:
        raise InvalidRequest("limit and next_page_token must be integers", param="next_page_token") from None
    if not 1 <= limit <= MAX_PAGE or start < 0:
        raise InvalidRequest(f"limit must be 1..{MAX_PAGE} and next_page_token >= 0", param="limit")
    ordered = sorted(services, key=lambda s: s.name)
    body: dict = {"models": [entry(s) for s in ordered[start:start + limit]]}
    if start + limit < len(ordered):
        body["nextPageToken"] = str(start + limit)
    return body


def loaded(name: str) -> str:
    return json.dumps({"status": f"Model \"{name}\" registered"})


def target_model() -> str | None:
    """The InvokeEndpoint TargetModel SageMaker forwards (for the log; the path names the model)."""
    return request.headers.get("X-Amzn-SageMaker-Target-Model")
