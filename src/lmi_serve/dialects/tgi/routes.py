"""Text Generation Inference (TGI) dialect: what the `text-generation` client and TGI users expect.

POST /  (array body, or SSE with `stream`), POST /generate (one object), POST /generate_stream
(SSE), GET /info, GET /health (and GET /), POST /tokenize (a body with `inputs`, mounted by
openai/tokenize.py). Errors are `{"error", "error_type"}` (also the app's own
404/405/413/500 on these paths and on POST /): the routes raise the core's error kinds and the app
renders them through `protocol.ERROR_TABLE` (400 a body that is not acceptable JSON, 422
validation, 424 generation, 429 overloaded, 503 unhealthy). A stream whose request fails before
its first token answers that error status; streams never end with `[DONE]` (the client would choke
on it), and an error after the stream started is a final `data:` error object.

A vision-language model reads markdown images (`![](data:image/png;base64,...)`) in `inputs` as TGI
does (images.py).

TGI's own defaults are kept: a request without `parameters` samples (`do_sample` true); POST `/`
returns the prompt with the text unless `return_full_text` is set. Parameters follow the LMI
rolling-batch schema (a superset of TGI's; values are coerced, "5" is 5, before any rule), plus
TGI's stricter rules: temperature > 0 when given, top_k > 0 when given, no `decoder_input_details`
with a stream, no `num_beams` or `output_formatter` (LMI-only). TGI's `grammar` (json, regex,
json_schema) and `watermark` are honoured per row; a grammar the compiler refuses is a 422 naming
`parameters.grammar` (`lmi_serve.dialects.common.guided`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace

from flask import Blueprint, Response, current_app, request

from lmi_serve.dialects.common import guided
from lmi_serve.dialects.common import streaming
from lmi_serve.dialects.common.disconnect import wait_for_results
from lmi_serve.dialects.common.ranking import rank_with_seeds
from lmi_serve.dialects.common.schema import RollingRequest, to_generation_requests
from lmi_serve.dialects.common.shapes import RenderContext
from lmi_serve.dialects.tgi import images
from lmi_serve.dialects.tgi.protocol import check_context, error_response, parse_request, tgi_response, tgi_stream_frame
from lmi_serve.engine.engine import Engine
from lmi_serve.engine.generation import Generation
from lmi_serve.errors import InvalidRequest
from lmi_serve.serving.registry import ModelRegistry
from lmi_serve.serving.service import ModelStatus

blueprint = Blueprint("tgi", __name__)
ERROR_PREFIXES = ("/generate", "/info", "/health")  # app-level 404/405/413 render in TGI shape here
ERROR_POST_PATHS = ("/",)  # and on exactly these paths when POSTed (`/` is otherwise LMI's prefix)


def _registry() -> ModelRegistry:
    return current_app.extensions["lmi_serve.serving.registry"]


def _service():
    return _registry().for_invocations(request.args.get("model_name") or request.headers.get("model_name"))


def _engine() -> tuple[str, Engine]:
    service = _service()
    return service.name, service.rolling_engine("the TGI routes")


def _parse(*, default_full_text: bool, stream_route: bool) -> RollingRequest:
    return parse_request(request.get_data(), default_full_text=default_full_text, stream_route=stream_route)


def _submit(parsed: RollingRequest) -> tuple[RenderContext, Generation]:
    service = _service()
    engine, vision = service.rolling_engine("the TGI routes"), getattr(service, "vision", None)
    pictures = None
    if vision is not None:  # markdown images in `inputs` (images.py)
        prompt_ids, pictures = images.prompt_with_images(vision, parsed.inputs, parsed.parameters.truncate)
    else:
        prompt_ids = engine.tokenizer(parsed.inputs).input_ids
    if parsed.parameters.truncate:
        prompt_ids = prompt_ids[-parsed.parameters.truncate:]
    check_context(len(prompt_ids), parsed.parameters.max_new_tokens, engine.max_model_len)
    # Within the context now, so the shared conversion cannot refuse it; a full queue raises
    # Overloaded, which the error table answers.
    requests = to_generation_requests(parsed.parameters, prompt_ids, eos_token_ids=engine.eos_token_ids,
                                      max_model_len=engine.max_model_len, max_input_len=engine.max_model_len - 1)
    if pictures is not None:  # every sequence of the request sees the same images
        requests = [replace(r, images=pictures) for r in requests]
    generation = guided.generate(engine, requests, "parameters.grammar")
    ctx = RenderContext.for_request(parsed, tgi_compat=True, seed=requests[0].sampling.seed,
                                    prompt_tokens_count=len(requests[0].prompt_ids))
    return ctx, generation


def _generate(as_list: bool) -> Response:
    parsed = _parse(default_full_text=as_list, stream_route=False)
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
            yield streaming.sse_event(tgi_stream_frame(ctx, events))  # never a [DONE]: the client chokes on it

    return Response(frames(), mimetype=streaming.SSE_MIMETYPE, headers=streaming.SSE_HEADERS)


@blueprint.post("/")
def compat_generate() -> Response:
    return _generate(as_list=True)


@blueprint.post("/generate")
def generate() -> Response:
    return _generate(as_list=False)


@blueprint.post("/generate_stream")
def generate_stream() -> Response:
    parsed = _parse(default_full_text=False, stream_route=True)
    return _stream(parsed)


def tokenize() -> Response:
    """TGI's POST /tokenize (mounted with vLLM's, see openai/tokenize.py): a GenerateRequest body ->
    one `{"id", "text", "start", "stop"}` per prompt token, the generation request's own ids
    (`truncate` applied); start/stop are character offsets into `inputs` and `text` the characters
    between them (a special token the tokenizer adds covers none)."""
    parsed = _parse(default_full_text=False, stream_route=False)
    _, engine = _engine()
    if not getattr(engine.tokenizer, "is_fast", False):
        raise InvalidRequest("This model's tokenizer gives no character offsets; /tokenize needs a fast tokenizer",
                             param="inputs")
    encoding = engine.tokenizer(parsed.inputs, return_offsets_mapping=True)
    pairs = list(zip(encoding.input_ids, encoding.offset_mapping))
    if parsed.parameters.truncate:
        pairs = pairs[-parsed.parameters.truncate:]
    body = [{"id": token_id, "text": parsed.inputs[start:stop], "start": start, "stop": stop}
            for token_id, (start, stop) in pairs]
    return Response(json.dumps(body, ensure_ascii=False), mimetype="application/json")


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
    tag = "text2text-generation" if engine.encoder_decoder else "text-generation"
    body = {"model_id": name, "model_sha": None, "model_pipeline_tag": tag,
            "model_dtype": str(engine.model.dtype).replace("torch.", ""), "model_device_type": engine.device.type,
            "max_concurrent_requests": engine.scheduler.max_queue, "max_best_of": 16, "max_stop_sequences": None,
            "max_input_tokens": engine.max_model_len - 1, "max_total_tokens": engine.max_model_len,
            "max_batch_size": engine.scheduler.max_batch_size, "validation_workers": 1,
            "max_client_batch_size": 1, "router": "lmi-serve", "version": _version(), "sha": None,
            "docker_label": None}
    return Response(json.dumps(body), mimetype="application/json")


def _version() -> str:
    from lmi_serve import __version__

    return __version__
