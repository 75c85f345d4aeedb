"""Text Generation Inference (TGI) dialect: what the `text-generation` client and TGI users expect.

POST /  (array body, or SSE with `stream`), POST /generate (one object), POST /generate_stream
(SSE), GET /info, GET /health (and GET /). Errors are `{"error", "error_type"}` (also the app's own
404/405/413/500 on these paths and on POST /): 400 a body that is not acceptable JSON (json_body),
422 validation, 424 generation, 429 overloaded, 503 unhealthy. Streams never end with `[DONE]` (the client would
choke on it); an error after the stream started is a final `data:` error object.

TGI's own defaults are kept: a request without `parameters` samples (`do_sample` true); POST `/`
returns the prompt with the text unless `return_full_text` is set. Parameters follow the LMI
rolling-batch schema (a superset of TGI's; values are coerced, "5" is 5, before any rule), plus
TGI's stricter rules: temperature > 0 when given, top_k > 0 when given, no `decoder_input_details`
with a stream, no `num_beams` or `output_formatter` (LMI-only).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from flask import Blueprint, Response, current_app, request

from ... import json_body
from ...disconnect import wait_for_results
from ...engine.engine import Engine
from ...engine.generation import Generation
from ...errors import (
    ClientGone, GenerationFailed, InvalidRequest, NotFound, NotReady, Overloaded, ServingError, Timeout, lookup,
)
from ...registry import ModelRegistry
from ...service import ModelStatus
from ..lmi.formatters import TGI_ERROR_PREFIX, RenderContext, tgi_response, tgi_stream_frame
from ..lmi.rolling import rank_with_seeds
from ..lmi.schema import (
    GenerationParameters, LmiRequestError, RollingRequest, parse_generation_parameters, to_generation_requests,
)

blueprint = Blueprint("tgi", __name__)
ERROR_PREFIXES = ("/generate", "/info", "/health")  # app-level 404/405/413 render in TGI shape here
ERROR_POST_PATHS = ("/",)  # and on exactly these paths when POSTed (`/` is otherwise LMI's prefix)


def error_response(status: int, error_type: str, message: str) -> Response:
    kinds = {400: "validation", 422: "validation", 424: "generation", 429: "overloaded", 503: "healthcheck"}
    body = {"error": message, "error_type": kinds.get(status, error_type)}
    return Response(json.dumps(body), status=status, mimetype="application/json")


class TgiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _registry() -> ModelRegistry:
    return current_app.extensions["lmi_serve.registry"]


def _engine() -> tuple[str, Engine]:
    service = _registry().for_invocations(request.args.get("model_name") or request.headers.get("model_name"))
    if service.current_status() is not ModelStatus.READY:
        raise TgiError(503, f"Model {service.name} is {service.current_status().value.lower()}")
    if service.engine is None:
        raise TgiError(424, f"Model {service.name} is served with dynamic batching; the TGI routes need the "
                            "rolling batch (option.rolling_batch=auto or scheduler)")
    return service.name, service.engine


def _parse(route_default_full_text: bool, stream_route: bool) -> RollingRequest:
    body = _decode_body()
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), str) or not body["inputs"]:
        raise TgiError(422, "Input validation error: `inputs` must be a non-empty string")
    unknown = sorted(set(body) - {"inputs", "parameters", "stream"})
    if unknown:
        raise TgiError(422, f"Input validation error: unknown field(s) {unknown}")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise TgiError(422, "Input validation error: `stream` must be true or false")
    stream = stream_route or bool(body.get("stream"))
    raw = body.get("parameters")
    if raw is None:
        raw = {"do_sample": True}  # TGI: no parameters object means sampling
    if isinstance(raw, dict) and raw.get("return_full_text") is None and route_default_full_text:
        raw = {**raw, "return_full_text": True}
    try:
        parameters = parse_generation_parameters(raw, stream=stream)
    except LmiRequestError as exc:
        raise TgiError(422, f"Input validation error: {exc}") from None
    _check_tgi_rules(parameters, stream)
    return RollingRequest(body["inputs"], parameters, stream)


def _decode_body() -> object:
    """The body as JSON; TGI answers 400 to a body that is not JSON (invalid, too deep, lone surrogates)."""
    try:
        return json_body.loads(request.get_data())
    except json_body.InvalidJson as exc:
        raise TgiError(400, str(exc)) from None


def _check_tgi_rules(parameters: GenerationParameters, stream: bool) -> None:
    """TGI's rules beyond the shared schema, on the validated (coerced) values."""
    if parameters.temperature is not None and parameters.temperature <= 0:
        raise TgiError(422, "Input validation error: `temperature` must be strictly positive")
    if parameters.top_k is not None and parameters.top_k <= 0:
        raise TgiError(422, "Input validation error: `top_k` must be strictly positive")
    if stream and parameters.decoder_input_details:
        raise TgiError(422, "Input validation error: `decoder_input_details` == true is not supported "
                            "when streaming tokens")
    if parameters.num_beams > 1:
        raise TgiError(422, "Input validation error: `num_beams` is not a TGI parameter; beam search is "
                            "available on /invocations")
    if parameters.output_formatter is not None:  # the TGI routes always answer in TGI's shapes
        raise TgiError(422, "Input validation error: `output_formatter` is not a TGI parameter; output "
                            "formatters apply on /invocations")


def _submit(parsed: RollingRequest) -> tuple[RenderContext, Generation]:
    _, engine = _engine()
    prompt_ids = engine.tokenizer(parsed.inputs).input_ids
    if parsed.parameters.truncate:
        prompt_ids = prompt_ids[-parsed.parameters.truncate:]
    asked = parsed.parameters.max_new_tokens
    if len(prompt_ids) + asked > engine.max_model_len:  # TGI refuses instead of capping
        raise TgiError(422, f"Input validation error: `inputs` tokens + `max_new_tokens` must be <= "
                            f"{engine.max_model_len}. Given: {len(prompt_ids)} `inputs` tokens and {asked} "
                            "`max_new_tokens`")
    try:
        requests = to_generation_requests(parsed.parameters, prompt_ids,
                                          eos_token_ids=engine.eos_token_ids, max_model_len=engine.max_model_len,
                                          max_input_len=engine.max_model_len - 1)
        generation = engine.generate(requests)
    except LmiRequestError as exc:
        raise TgiError(422, f"Input validation error: {exc}") from None
    except Overloaded:
        raise TgiError(429, "Model is overloaded") from None
    ctx = RenderContext.for_request(parsed, tgi_compat=True, seed=requests[0].sampling.seed,
                                    prompt_tokens_count=len(requests[0].prompt_ids))
    return ctx, generation


def _generate(as_list: bool) -> Response:
    parsed = _parse(route_default_full_text=as_list, stream_route=False)
    if parsed.stream:
        return _stream(parsed)
    ctx, generation = _submit(parsed)
    results = wait_for_results(generation)  # cancelled if the client goes away meanwhile
    ctx, ranked = rank_with_seeds(ctx, generation.requests, results, parsed.parameters.n)
    body = tgi_response(ctx, ranked[0].events, [r.events for r in ranked[1:]])
    status = 424 if "error" in body else 200
    headers = {"x-prompt-tokens": str(ctx.prompt_tokens_count), "x-generated-tokens": str(ranked[0].generated_tokens)}
    return Response(json.dumps([body] if as_list and status == 200 else body, ensure_ascii=False),
                    status=status, mimetype="application/json", headers=headers)


def _stream(parsed: RollingRequest) -> Response:
    ctx, generation = _submit(parsed)
    generation.start()  # a failure before the first token is an error status, not a 200 and an error frame

    def frames() -> Iterator[str]:
        events = []
        for _, event in generation.events():  # closing it (client gone) cancels the request
            events.append(event)
            yield "data: " + json.dumps(tgi_stream_frame(ctx, events), ensure_ascii=False) + "\n\n"

    return Response(frames(), mimetype="text/event-stream", headers={"X-Accel-Buffering": "no"})


@blueprint.errorhandler(TgiError)
def tgi_error(exc: TgiError) -> Response:
    return error_response(exc.status, "", exc.message)


# kind -> (status, TGI's error_type, what the message starts with)
ERROR_TABLE: dict[type[ServingError], tuple[int, str, str]] = {
    InvalidRequest: (422, "validation", ""),
    NotFound: (404, "not_found", ""),
    NotReady: (503, "healthcheck", ""),
    Overloaded: (429, "overloaded", ""),
    Timeout: (424, "generation", TGI_ERROR_PREFIX),
    GenerationFailed: (424, "generation", TGI_ERROR_PREFIX),
    ClientGone: (499, "client_closed_request", ""),
    ServingError: (500, "internal", ""),
}


def render_kind(error: ServingError) -> Response:
    status, error_type, prefix = lookup(ERROR_TABLE, error)
    return error_response(status, error_type, prefix + error.message)


@blueprint.post("/")
def compat_generate() -> Response:
    return _generate(as_list=True)


@blueprint.post("/generate")
def generate() -> Response:
    return _generate(as_list=False)


@blueprint.post("/generate_stream")
def generate_stream() -> Response:
    parsed = _parse(route_default_full_text=False, stream_route=True)
    return _stream(parsed)


@blueprint.get("/")
@blueprint.get("/health")
def health() -> Response:
    status, _ = _registry().health()
    if status is not ModelStatus.READY:
        return error_response(503, "healthcheck", "unhealthy")
    return Response(status=200)


@blueprint.get("/info")
def info() -> Response:
    name, engine = _engine()
    body = {"model_id": name, "model_sha": None, "model_pipeline_tag": "text-generation",
            "model_dtype": str(engine.model.dtype).replace("torch.", ""), "model_device_type": engine.device.type,
            "max_concurrent_requests": engine.scheduler.max_queue, "max_best_of": 16, "max_stop_sequences": None,
            "max_input_tokens": engine.max_model_len - 1, "max_total_tokens": engine.max_model_len,
            "max_batch_size": engine.scheduler.max_batch_size, "validation_workers": 1,
            "max_client_batch_size": 1, "router": "lmi-serve", "version": _version(), "sha": None,
            "docker_label": None}
    return Response(json.dumps(body), mimetype="application/json")


def _version() -> str:
    from ... import __version__

    return __version__
