"""LMI's (DJL serving's) rendering of the core's error kinds: status and DJL's exception name.

The LMI renderer also answers paths no dialect owns, so its body carries `error` too: clients of
the other dialects (the `text-generation` client, for one) read `error` from any error body.
"""

from __future__ import annotations

import json

from flask import Response

from lmi_serve.json_body import InvalidJson
from lmi_serve.errors import (
    AlreadyExists, ClientGone, Forbidden, GenerationFailed, InvalidRequest, NotFound, NotReady, OutOfResources,
    Overloaded, ServingError, Timeout, lookup,
)

# kind -> (status, DJL's exception name)
ERROR_TABLE: dict[type[ServingError | InvalidJson], tuple[int, str]] = {
    InvalidJson: (400, "BadRequestException"),  # a body that is not JSON we accept
    InvalidRequest: (400, "BadRequestException"),
    NotFound: (404, "ModelNotFoundException"),
    NotReady: (503, "ServiceUnavailableException"),
    Overloaded: (503, "WlmCapacityException"),
    Timeout: (504, "TimeoutException"),
    GenerationFailed: (424, "InvokeHandlerFailure"),
    AlreadyExists: (409, "ConflictStatusException"),  # a model name already loaded (SageMaker MME's 409)
    OutOfResources: (507, "InsufficientStorageException"),  # SageMaker MME: unload some models, then retry
    Forbidden: (403, "ForbiddenException"),
    ClientGone: (499, "ClientClosedRequest"),  # nginx's code: nobody reads it, the access log does
    ServingError: (500, "InternalServerException"),
}


def error_response(status: int, error_type: str, message: str) -> Response:
    """LMI's management-style error body, plus `error` (the message again)."""
    body = {"code": status, "type": error_type, "message": message, "error": message}
    return Response(json.dumps(body), status=status, mimetype="application/json")


def render_kind(error: ServingError | InvalidJson) -> Response:
    status, error_type = lookup(ERROR_TABLE, error)
    return error_response(status, error_type, error.message)
