"""OpenAI-compatible routes: POST /v1/chat/completions, /v1/completions, /v1/embeddings; GET /v1/models.

`model` picks among the served models (`choose_service`) or names a registered LoRA adapter of one
(vLLM's convention; /v1/models lists adapters with `parent` = their model); without it, the first
model of the route's task; an unknown name selects the only text-generation model, as TGI does
(unless `LMI_SERVE_STRICT_MODEL_NAMES`, or LoRA adapters are served), else 404 `model_not_found`
listing the served names. Errors are the core's kinds, answered in OpenAI's envelope by the one table in
errors.py: 400 for every validation error, 404, 429 with `retry-after` when the queue is full, 503
while loading, 504 on a queue timeout, 500 only for real faults.
Streams are SSE ending with `data: [DONE]`.
"""

from __future__ import annotations

import base64
import json
import struct
import sys
import time
import uuid
from typing import Any

from flask import Blueprint, Response, request

from lmi_serve import json_body
from lmi_serve.dialects.common import streaming
from lmi_serve.json_body import InvalidJson
from lmi_serve.dialects.openai import vllm
from lmi_serve.dialects.openai.errors import render_kind
from lmi_serve.dialects.openai.generation import check_token_ids
from lmi_serve.dialects.openai.model_choice import EMBEDDING_TASK, adapter_owner as _adapter_owner
from lmi_serve.dialects.openai.model_choice import adapters_of as _adapters_of
from lmi_serve.dialects.openai.model_choice import chat_service as _generation
# tokenize.py, scoring.py and tests import choose_service from here
from lmi_serve.dialects.openai.model_choice import choose_service  # noqa: F401
from lmi_serve.dialects.openai.model_choice import ready_service as _service
from lmi_serve.dialects.openai.model_choice import registry as _registry
from lmi_serve.dialects.openai.schema import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, parse
from lmi_serve.dialects.openai.service import Reply
from lmi_serve.errors import ContextOverflow, GenerationFailed, InvalidRequest, NotFound, ServingError
from lmi_serve.handler_api import Input
from lmi_serve.serving.service import ModelService

blueprint = Blueprint("openai", __name__, url_prefix="/v1")
ERROR_PREFIXES = ("/v1",)


@blueprint.errorhandler(ServingError)
@blueprint.errorhandler(InvalidJson)
def _serving_error(exc: ServingError | InvalidJson) -> Response:
    # app.py renders kinds by URL too; this keeps the blueprint whole on its own (unit tests mount it alone)
    return render_kind(exc)


def _body() -> Any:
    """The decoded body; too deep, lone surrogates, NaN and non-JSON are a 400 (json_body's rules)."""
    return json_body.loads(request.get_data())


def _reply(reply: Reply) -> Response:
    if reply.chunks is None:
        return Response(json.dumps(reply.body), mimetype="application/json")
    return Response(reply.sse(), mimetype=streaming.SSE_MIMETYPE, headers=streaming.SSE_HEADERS)


@blueprint.post("/chat/completions")
def chat_completions() -> Response:
    parsed = parse(ChatCompletionRequest, _body())
    return _reply(_generation(parsed.model).chat(parsed))


@blueprint.post("/completions")
def completions() -> Response:
    parsed = parse(CompletionRequest, _body())
    return _reply(_generation(parsed.model).completions(parsed))


@blueprint.post("/embeddings")
def embeddings() -> Response:
    parsed: EmbeddingRequest = parse(EmbeddingRequest, _body())
    service = _service(parsed.model, EMBEDDING_TASK)
    handler = service.capabilities
    if handler.count_tokens is None or handler.embedding_limits is None:
        raise InvalidRequest(f"The model `{service.name}`'s handler does not expose count_tokens and "
                             "embedding_limits, which /v1/embeddings needs for usage and limits", param="model")
    inputs = _embedding_inputs(parsed, handler)
    dimension, max_tokens = handler.embedding_limits()
    options = _embedding_options(parsed, handler, service.name, dimension)
    prompt, prompt_pooled = _embedding_prompt(parsed, handler, inputs)
    counts = _token_counts([prompt + x if isinstance(x, str) else x for x in inputs], handler)
    inputs, counts = _truncated(parsed, inputs, counts, handler, max_tokens, prompt, prompt_pooled)
    for i, count in enumerate(counts):
        if count > max_tokens:
            raise ContextOverflow(f"Input {i} has {count} tokens; this model's maximum is {max_tokens} tokens",
                                  param="input")
    payload = {"inputs": inputs, **options, **({"prompt": prompt} if handler.embedding_prompt else {})}
    job = service.submit(Input.from_http(json.dumps(payload).encode(), {"Content-Type": "application/json"}, [], ""))
    output = service.dispatcher.wait(job)
    if output.code != 200:
        message = output.body().decode("utf-8", "replace")
        raise GenerationFailed(message) if output.code >= 500 else InvalidRequest(message)
    vectors = json.loads(output.body())
    data = [{"object": "embedding", "index": i,
             "embedding": _encode(vector, parsed.encoding_format, parsed.embed_dtype, parsed.endianness)}
            for i, vector in enumerate(vectors)]
    total = sum(counts)
    ident = f"embd-{parsed.request_id or uuid.uuid4().hex}"  # vLLM's id: the client's request_id when it names one
    return Response(json.dumps({"id": ident, "object": "list", "data": data, "model": service.name,
                                "usage": {"prompt_tokens": total, "total_tokens": total}}), mimetype="application/json")


def _embedding_options(parsed: EmbeddingRequest, handler, name: str, dimension: int) -> dict:
    """`dimensions` and `normalize` for a handler that takes them (it declares embedding_prompt);
    for one that does not, only what it gives anyway: the full width, normalised."""
    options = {}
    if handler.embedding_prompt is None:
        if parsed.dimensions is not None and parsed.dimensions != dimension:
            raise InvalidRequest(f"The model `{name}` produces {dimension}-dimensional embeddings and its handler "
                                 "cannot shorten them; `dimensions` must be omitted or equal it", param="dimensions")
        if parsed.normalized is False:
            field = "use_activation" if parsed.use_activation is not None else "normalize"
            raise InvalidRequest(f"`{field}`: this model's handler serves its vectors as it gives them; unnormalised "
                                 "vectors are not available", param=field)
        return options
    if parsed.dimensions is not None:
        if parsed.dimensions > dimension:
            raise InvalidRequest(f"`dimensions` {parsed.dimensions} exceeds the {dimension} dimensions of the model "
                                 f"`{name}`; give 1 to {dimension}", param="dimensions")
        options["dimensions"] = parsed.dimensions
    if parsed.normalized is not None:
        options["normalize"] = parsed.normalized
    return options


def _embedding_prompt(parsed: EmbeddingRequest, handler, inputs: list) -> tuple[str, bool]:
    """(the text put before every text input, whether pooling reads its tokens): the request's
    `instruction`, the model's prompt `prompt_name`, or the model's default prompt."""
    if parsed.instruction and parsed.prompt_name is not None:
        raise InvalidRequest("`instruction` and `prompt_name` both give a prompt: send one", param="prompt_name")
    if parsed.prompt_name is not None:
        if handler.embedding_prompt is None:
            raise InvalidRequest("`prompt_name`: this model's handler declares no prompts", param="prompt_name")
        if any(isinstance(x, list) for x in inputs):
            raise InvalidRequest("`prompt_name` is put before text inputs; with token ids, put the prompt's tokens "
                                 "in the ids themselves", param="prompt_name")
    if handler.embedding_prompt is None:
        return "", True  # `instruction` is already in the texts (_embedding_inputs)
    try:
        prompt, pooled = handler.embedding_prompt(parsed.prompt_name)
    except ValueError as exc:
        raise InvalidRequest(f"`prompt_name`: {exc}", param="prompt_name") from None
    if parsed.instruction:
        # The instruction is put before every text, as instruction-tuned embedders (BGE, Instructor) expect.
        prompt = parsed.instruction + ("" if parsed.instruction[-1].isspace() else " ")
    return prompt, pooled


def _embedding_inputs(parsed: EmbeddingRequest, handler) -> list[str | list[int]]:
    """What the handler embeds: texts (with the instruction, for a handler without prompts), or
    token-id lists exactly as sent."""
    if parsed.token_id_inputs is not None:
        return _checked_token_ids(parsed, handler)
    texts = [parsed.input] if isinstance(parsed.input, str) else list(parsed.input)
    if any(not t for t in texts):
        raise InvalidRequest("input: texts must not be empty", param="input")
    if parsed.instruction and handler.embedding_prompt is None:
        sep = "" if parsed.instruction[-1].isspace() else " "
        texts = [f"{parsed.instruction}{sep}{t}" for t in texts]
    return texts


def _checked_token_ids(parsed: EmbeddingRequest, handler) -> list[list[int]]:
    if handler.vocabulary_size is None:
        raise InvalidRequest("This model's handler takes text input only (it has no vocabulary_size())",
                             param="input")
    if parsed.instruction:
        raise InvalidRequest("instruction is prefixed to text inputs; with token ids, put its tokens in the "
                             "ids themselves", param="instruction")
    lists = parsed.token_id_inputs
    for ids in lists:
        check_token_ids(ids, handler.vocabulary_size(), "input")
    return lists


def _token_counts(inputs: list[str | list[int]], handler) -> list[int]:
    """Tokens the model reads per input: the handler counts texts; token ids count themselves."""
    texts = [x for x in inputs if isinstance(x, str)]
    text_counts = iter(handler.count_tokens(texts) if texts else ())
    return [next(text_counts) if isinstance(x, str) else len(x) for x in inputs]


def _truncated(parsed: EmbeddingRequest, inputs: list[str | list[int]], counts: list[int], handler,
               max_tokens: int, prompt: str = "", prompt_pooled: bool = True) -> tuple[list[str | list[int]], list[int]]:
    """vLLM's `truncate_prompt_tokens` (-1: the model's limit) and `truncation_side`: an input
    longer than that keeps its last tokens (`left`, vLLM's default) or its first (`right`). Token ids
    are cut as sent; a text (with its `prompt` before it) is cut by the handler's tokenizer, special
    tokens kept, as vLLM's tokenizer truncates (`truncated_token_ids`), and sent as those ids; a
    handler without that refuses a text to cut, and so does a model whose pooling leaves its prompt
    out (the cut ids no longer say where the prompt ends)."""
    keep = parsed.truncate_prompt_tokens
    if keep is None:
        return inputs, counts
    keep = max_tokens if keep == -1 else keep
    if keep > max_tokens:
        raise InvalidRequest(f"truncate_prompt_tokens ({keep}) exceeds this model's limit of {max_tokens} tokens",
                             param="truncate_prompt_tokens")
    side = parsed.truncation_side or "left"
    long_texts = [i for i, (x, n) in enumerate(zip(inputs, counts)) if isinstance(x, str) and n > keep]
    cut_texts = {}
    if long_texts:
        if handler.truncated_token_ids is None or handler.vocabulary_size is None:
            first = long_texts[0]
            raise InvalidRequest(f"truncate_prompt_tokens: input {first} has {counts[first]} tokens and this model's "
                                 "handler cannot cut texts at a token (it has no truncated_token_ids()); send fewer "
                                 "tokens, or token ids", param="truncate_prompt_tokens")
        if prompt and not prompt_pooled:
            raise InvalidRequest(f"truncate_prompt_tokens: input {long_texts[0]} must be cut, and this model leaves its "
                                 "prompt's tokens out of pooling, which a cut input cannot keep apart; send fewer "
                                 "tokens", param="truncate_prompt_tokens")
        try:
            cut_texts = dict(zip(long_texts, handler.truncated_token_ids([prompt + inputs[i] for i in long_texts],
                                                                          keep, side)))
        except ValueError as exc:
            raise InvalidRequest(f"truncate_prompt_tokens: {exc}", param="truncate_prompt_tokens") from None
    out = [cut_texts[i] if i in cut_texts else vllm.truncated(x, keep, side) if isinstance(x, list) else x
           for i, x in enumerate(inputs)]
    return out, [len(x) if isinstance(x, list) else n for x, n in zip(out, counts)]


_BYTE_ORDERS = {"native": sys.byteorder, "little": "little", "big": "big"}


def _encode(vector: list[float], encoding: str, dtype: str = "float32", endianness: str = "native"):
    """A vector as sent: a float list, or for `base64` its bytes as vLLM lays them out, in
    `embed_dtype` (the value rounded to that type, as torch casts) and `endianness`. OpenAI's
    client reads the default, float32 little-endian (native on the machines this runs on)."""
    if encoding != "base64":
        return vector
    if dtype == "float32":
        order = "<" if _BYTE_ORDERS[endianness] == "little" else ">"
        return base64.b64encode(struct.pack(f"{order}{len(vector)}f", *vector)).decode("ascii")
    import torch  # only for the narrower types, whose rounding torch defines

    kinds = {"float16": torch.float16, "bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
             "fp8_e5m2": torch.float8_e5m2}
    cast = torch.tensor(vector, dtype=torch.float32).to(kinds[dtype])
    raw = cast.view(torch.uint8).numpy().reshape(len(vector), cast.element_size())
    if _BYTE_ORDERS[endianness] != sys.byteorder:
        raw = raw[:, ::-1]
    return base64.b64encode(raw.tobytes()).decode("ascii")


@blueprint.get("/models")
def list_models() -> Response:
    services = sorted(_registry().services.values(), key=lambda s: not s.generates_text)  # generation first
    created = int(time.time())
    data = [{"id": s.name, "object": "model", "created": int(s.loaded_at or created), "owned_by": "lmi-serve"}
            for s in services]
    data += [_adapter_card(s, a) for s in services if _adapters_of(s) is not None for a in _adapters_of(s).list()]
    return Response(json.dumps({"object": "list", "data": data}), mimetype="application/json")


def _adapter_card(service: ModelService, adapter) -> dict:
    """A LoRA adapter as vLLM lists one: its folder as `root`, the base model as `parent`."""
    return {"id": adapter.name, "object": "model", "created": int(adapter.registered_at), "owned_by": "lmi-serve",
            "root": str(adapter.spec.src), "parent": service.name}


@blueprint.get("/models/<path:name>")
def get_model(name: str) -> Response:
    service = _registry().services.get(name)
    owner = _adapter_owner(name) if service is None else None
    if owner is not None:
        return Response(json.dumps(_adapter_card(owner, _adapters_of(owner).get(name))), mimetype="application/json")
    if service is None:
        raise NotFound(f"The model `{name}` does not exist", param="model")
    return Response(json.dumps({"id": service.name, "object": "model", "created": int(service.loaded_at or time.time()),
                                "owned_by": "lmi-serve"}), mimetype="application/json")

