"""The generate extension: a flat JSON body mapped onto the model's tensors, and back.

Request mapping (Triton's, in body order): a top-level key that names a model input becomes that
tensor (a scalar or a 1-D array; datatype from the model; shape deduced from the model's shape);
`parameters` (an object) is mapped by the same rule one level deep; every other key (`id` too) is a
request parameter and must be a string, number or bool. A key given twice, in the body or both
top-level and inside `parameters`, is refused. Response: `model_name`, `model_version`, `id` when
given, and every output tensor as a key: one element as a bare value, otherwise a flat array.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from math import prod
from typing import Any

from lmi_serve.dialects.common.streaming import sse_event
from lmi_serve.dialects.triton.models import MODEL_VERSION, ModelContract
from lmi_serve.dialects.triton.protocol import BadRequest, JsonObject, TritonError, check_parameter, parse_json, printable
from lmi_serve.errors import ServingError
from lmi_serve.tensor_model import TensorSpec
from lmi_serve.tensors import TensorError, WireTensor, tensor_to_json_data, values_to_array


@dataclass
class GenerateRequest:
    tensors: list[WireTensor] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)
    request_id: str = ""


def deduce_shape(spec: TensorSpec, count: int) -> tuple[int, ...]:
    """Divide the element count by every fixed dimension; the innermost -1 takes what is left and
    every other -1 is 1. Anything that does not divide evenly cannot be this input."""
    remaining = count
    for dim in spec.shape:
        if dim != -1:
            if dim == 0 or remaining % dim:
                raise BadRequest(f"The schema can not convert input '{spec.name}' to tensor with proper shape")
            remaining //= dim
    shape = [1 if d == -1 else d for d in spec.shape]
    variable = [i for i, d in enumerate(spec.shape) if d == -1]
    if variable:
        shape[variable[-1]] = remaining
    elif remaining != 1:
        raise BadRequest(f"The schema can not convert input '{spec.name}' to tensor with proper shape")
    return tuple(shape)


def _tensor(spec: TensorSpec, value: Any, model: str) -> WireTensor:
    values = value if isinstance(value, list) else [value]
    if spec.datatype in ("FP16", "BF16"):
        raise BadRequest(f"receiving {spec.datatype} data via JSON is not supported. Please use the binary "
                         f"data format for input {spec.name}")
    try:
        array = values_to_array(spec.datatype, values, spec.name)
    except TensorError as exc:
        raise BadRequest(str(exc)) from None
    shape = deduce_shape(spec, len(values))
    return WireTensor(spec.name, spec.datatype, shape, array.reshape(shape))


def _map_keys(obj: JsonObject, contract: ModelContract, model: str, request: GenerateRequest,
              seen: set[str]) -> None:
    if obj.duplicate is not None:
        _already_exists(obj.duplicate, contract)
    for key, value in obj.items():
        if key in seen:
            _already_exists(key, contract)
        seen.add(key)
        spec = contract.input(key)
        if spec is not None:
            request.tensors.append(_tensor(spec, value, model))
        else:
            check_parameter(key, value)
            request.parameters[key] = value


def _already_exists(key: str, contract: ModelContract) -> None:
    what = "input" if contract.input(key) is not None else "parameter"
    raise BadRequest(f"{what} '{key}' already exists in request")


def parse_generate_request(body: bytes, model: str, contract: ModelContract) -> GenerateRequest:
    obj = parse_json(body) if body.strip() else JsonObject()
    if not isinstance(obj, JsonObject):
        raise BadRequest("failed to parse the request JSON buffer: expected a JSON object")
    request, seen = GenerateRequest(), set()
    nested = obj.get("parameters")
    if "parameters" in obj and not isinstance(nested, JsonObject):
        raise BadRequest("Expected JSON object for keyword: 'parameters'")
    top = JsonObject((k, v) for k, v in obj.items() if k != "parameters")
    top.duplicate = obj.duplicate
    _map_keys(top, contract, model, request, seen)
    if nested is not None:
        try:
            _map_keys(nested, contract, model, request, seen)
        except TritonError as exc:
            raise exc.reworded(f"Converting keyword: 'parameters': {exc.message}") from None
    request_id = obj.get("id")
    request.request_id = request_id if isinstance(request_id, str) else ""
    return request


def response_object(model: str, request_id: str, outputs: list[WireTensor]) -> dict:
    body: dict[str, Any] = {"model_name": model, "model_version": MODEL_VERSION}
    if request_id:
        body["id"] = request_id
    for tensor in outputs:
        try:
            data = tensor_to_json_data(tensor)
        except TensorError as exc:
            raise BadRequest(str(exc)) from None
        body[tensor.name] = data[0] if prod(tensor.shape) == 1 else data
    return body


def dumps(body: dict) -> str:
    """Compact, keys in byte order (as Triton builds them): Triton's JSON options, which the shared
    `streaming.dumps` does not take (it keeps insertion order)."""
    return json.dumps(body, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def error_event(message: object) -> str:
    """An error as Triton streams it: one `data: {"error": ...}` event."""
    return sse_event(dumps({"error": printable(message)}))


def sse_events(model: str, request_id: str, responses: Iterable[list[WireTensor]]) -> Iterator[str]:
    """One `data: {json}` event per response, nothing else (no `[DONE]`); an error ends the stream
    as a `data: {"error": ...}` event (the status line has been sent: it cannot change now)."""
    try:
        for outputs in responses:
            yield sse_event(dumps(response_object(model, request_id, outputs)))
    except (TritonError, ServingError) as exc:  # a Triton protocol error, or the model's failure kind
        yield error_event(exc.message)
    finally:
        close = getattr(responses, "close", None)
        if close is not None:
            close()  # the client went away: cancel the generation
