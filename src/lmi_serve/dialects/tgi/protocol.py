"""TGI's wire protocol without Flask's request: parsing, the error table, the response shapes.

- `parse_request(body, ...)`: the raw body bytes -> a RollingRequest, or an error kind: `NotJson`
  (400) for a body that is not JSON we accept, InvalidRequest (422) for every other problem.
- `ERROR_TABLE`: the one map from the core's error kinds to TGI's status, `error_type` and the
  words TGI puts before the message ("Input validation error: ", "Request failed during
  generation: "); `render_kind` renders a kind through it, `error_response` an HTTP-level error.
- `tgi_response`, `tgi_stream_frame`, `tgi_error_body`: TGI's response shapes, kept in
  `common.tgi_shapes` because LMI's formatters render them too (`tgi_compat`); imported here for
  TGI's routes.

The request schema is the rolling-batch one LMI shares (`common.schema`); TGI and LMI never import
each other.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from flask import Response

from lmi_serve import echo, json_body
from lmi_serve.dialects.common.schema import GenerationParameters, RollingRequest, parse_generation_parameters
from lmi_serve.dialects.common.tgi_shapes import TGI_ERROR_PREFIX, tgi_error_body, tgi_response, tgi_stream_frame
from lmi_serve.errors import (
    ClientGone, ContextOverflow, GenerationFailed, InvalidRequest, NotFound, NotReady, Overloaded, ServingError,
    Timeout, lookup,
)

VALIDATION_PREFIX = "Input validation error: "
BODY_FIELDS = ("inputs", "parameters", "stream")


# The body is not JSON this server accepts (invalid, too deep, lone surrogates): TGI answers 400 there,
# where any other invalid request gets 422. The server's one JSON-body error, under TGI's name for it.
NotJson = json_body.InvalidJson


# --- parsing --------------------------------------------------------------------------------

def parse_request(body: bytes, *, default_full_text: bool, stream_route: bool) -> RollingRequest:
    """A TGI request body as a RollingRequest. `default_full_text`: the route returns the prompt
    with the text unless `return_full_text` says otherwise (POST /); `stream_route`: the route
    always streams (POST /generate_stream)."""
    payload = decode_body(body)
    if not isinstance(payload, dict) or not isinstance(payload.get("inputs"), str) or not payload["inputs"]:
        raise InvalidRequest("`inputs` must be a non-empty string", param="inputs")
    unknown = echo.unknown(payload, BODY_FIELDS)
    if unknown:
        raise InvalidRequest(f"unknown field(s) {echo.names(unknown)}", param=echo.first(unknown))
    if payload.get("stream") is not None and not isinstance(payload["stream"], bool):
        raise InvalidRequest("`stream` must be true or false", param="stream")
    stream = stream_route or bool(payload.get("stream"))
    raw = payload.get("parameters")
    if raw is None:
        raw = {"do_sample": True}  # TGI: no parameters object means sampling
    if isinstance(raw, dict) and raw.get("return_full_text") is None and default_full_text:
        raw = {**raw, "return_full_text": True}
    if isinstance(raw, dict) and "adapter_id" in raw:  # TGI's name for the LoRA adapter to use
        raw = {**raw}
        adapter = raw.pop("adapter_id")
        if adapter is not None and "adapters" in raw:
            raise InvalidRequest("give `adapter_id` only", param="adapter_id")
        if adapter is not None:
            raw["adapters"] = adapter
    parameters = parse_generation_parameters(raw, stream=stream)  # its refusals are InvalidRequests
    check_tgi_rules(parameters, stream)
    return RollingRequest(payload["inputs"], parameters, stream)


def decode_body(body: bytes) -> Any:
    """The body as JSON; NotJson (TGI's 400) when it is not JSON we accept (more object keys or
    values than TGI's fixed schema can use included: json_body.FIXED_SCHEMA_KEYS / _VALUES)."""
    return json_body.loads(body, max_keys=json_body.FIXED_SCHEMA_KEYS, max_values=json_body.FIXED_SCHEMA_VALUES)


def check_tgi_rules(parameters: GenerationParameters, stream: bool) -> None:
    """TGI's rules beyond the shared schema, on the validated (coerced) values."""
    if parameters.temperature is not None and parameters.temperature <= 0:
        raise InvalidRequest("`temperature` must be strictly positive", param="temperature")
    if parameters.top_k is not None and parameters.top_k <= 0:
        raise InvalidRequest("`top_k` must be strictly positive", param="top_k")
    if stream and parameters.decoder_input_details:
        raise InvalidRequest("`decoder_input_details` == true is not supported when streaming tokens",
                             param="decoder_input_details")
    if parameters.num_beams > 1:
        raise InvalidRequest("`num_beams` is not a TGI parameter; beam search is available on /invocations",
                             param="num_beams")
    if parameters.output_formatter is not None:  # the TGI routes always answer in TGI's shapes
        raise InvalidRequest("`output_formatter` is not a TGI parameter; output formatters apply on "
                             "/invocations", param="output_formatter")


def check_context(prompt_tokens: int, max_new_tokens: int, max_model_len: int) -> None:
    """TGI refuses a request whose prompt and `max_new_tokens` exceed the context (LMI caps
    instead), in TGI's words, which name `max_new_tokens` as the field to change."""
    if prompt_tokens < 1:
        raise InvalidRequest("`inputs` encodes to no tokens", param="inputs")
    if prompt_tokens + max_new_tokens > max_model_len:
        raise ContextOverflow(f"`inputs` tokens + `max_new_tokens` must be <= {max_model_len}. Given: "
                              f"{prompt_tokens} `inputs` tokens and {max_new_tokens} `max_new_tokens`",
                              param="max_new_tokens")


# --- errors ---------------------------------------------------------------------------------

class TgiRow(NamedTuple):
    status: int
    error_type: str
    prefix: str = ""  # what TGI writes before the kind's message
    message: str | None = None  # TGI's own fixed words instead of the kind's message


# kind -> TGI's answer; a kind not listed takes its nearest base class's row
ERROR_TABLE: dict[type[ServingError | NotJson], TgiRow] = {
    NotJson: TgiRow(400, "validation"),
    InvalidRequest: TgiRow(422, "validation", VALIDATION_PREFIX),
    ContextOverflow: TgiRow(422, "validation", VALIDATION_PREFIX),
    NotFound: TgiRow(404, "not_found"),
    NotReady: TgiRow(503, "healthcheck"),
    Overloaded: TgiRow(429, "overloaded", message="Model is overloaded"),  # TGI's words, whatever the queue says
    Timeout: TgiRow(424, "generation", TGI_ERROR_PREFIX),
    GenerationFailed: TgiRow(424, "generation", TGI_ERROR_PREFIX),
    ClientGone: TgiRow(499, "client_closed_request"),
    ServingError: TgiRow(500, "internal"),
}

# HTTP-level errors (Flask's 404/405/413, a 500) that share a status with a TGI error_type
_HTTP_ERROR_TYPES = {400: "validation", 401: "unauthorized", 403: "forbidden", 422: "validation", 424: "generation",
                     429: "overloaded", 503: "healthcheck"}


def _json_error(status: int, error_type: str, message: str) -> Response:
    body = {"error": message, "error_type": error_type}
    return Response(json.dumps(body), status=status, mimetype="application/json")


def error_response(status: int, error_type: str, message: str) -> Response:
    """An HTTP-level error (it comes with its status) in TGI's `{"error", "error_type"}` shape."""
    return _json_error(status, _HTTP_ERROR_TYPES.get(status, error_type), message)


def render_kind(error: ServingError | NotJson) -> Response:
    row = lookup(ERROR_TABLE, error)
    return _json_error(row.status, row.error_type, row.prefix + (row.message or error.message))
