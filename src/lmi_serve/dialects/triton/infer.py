"""POST .../infer: the KServe v2 inference request and response, with binary tensor data.

Request (after Content-Encoding is undone): the first Inference-Header-Content-Length bytes are the
JSON header (the whole body without the header); each input with `parameters.binary_data_size`
then takes that many bytes of the rest, in the order of `inputs`; JSON `data` inputs take none.
IHCL 0 means a raw request: the whole body is the one input's data. Response: outputs flagged
binary follow the JSON header in the order of `outputs`, and IHCL tells where the JSON ends.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from math import prod
from typing import Any

from flask import Response

from lmi_serve import json_body
from lmi_serve.dialects.triton.models import MODEL_VERSION, ModelContract
from lmi_serve.dialects.triton.protocol import BadRequest, JsonObject, check_parameter, compress_for_client, parse_json
from lmi_serve.tensors import (ELEMENT_SIZES, TensorError, WireTensor, check_datatype, parse_shape, tensor_from_binary,
                      tensor_from_json, tensor_to_binary, tensor_to_json_data)

_INT32_MAX = 2**31 - 1
_DATA_FIELDS = ("data", "binary_data_size", "shared_memory_region")


@dataclass
class InferRequest:
    inputs: list[WireTensor]
    request_id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    requested_outputs: list[str] | None = None  # None: every output the model produces
    binary_outputs: set[str] | None = None  # None: all outputs binary (raw requests, binary_data_output)
    all_json: bool = False  # outputs omitted and binary_data_output not set


def header_length(value: str | None, body_size: int) -> int | None:
    if value is None:
        return None
    try:
        length = int(value.strip())
    except ValueError:
        raise BadRequest(f"Unable to parse Inference-Header-Content-Length, got: {value}") from None
    if length > _INT32_MAX:
        raise BadRequest(f"Unable to parse Inference-Header-Content-Length, got: {value}, value is out of "
                         f"range [0, {_INT32_MAX}]")
    if length < 0 or length > body_size:
        raise BadRequest(f"inference header size should be in range (0, {body_size}), got: {length}")
    return length


def _object(value: Any, what: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"Unable to parse '{what}': expected a JSON object")
    return value


def _request_parameters(raw: Any) -> dict[str, Any]:
    parameters = dict(_object(raw, "parameters"))
    for key, value in parameters.items():
        check_parameter(key, value)
    if not isinstance(parameters.get("binary_data_output", False), bool):
        raise BadRequest("Unable to parse 'binary_data_output': expected a boolean")
    return parameters


def _input_tensor(entry: Any, model: str, rest: memoryview, offset: int) -> tuple[WireTensor, int]:
    """One `inputs` entry; binary ones consume bytes of `rest` from `offset`. Returns the new offset."""
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise BadRequest("Unable to parse 'inputs': each input needs a string 'name'")
    name = entry["name"]
    datatype = check_datatype(entry.get("datatype"), name)
    shape = parse_shape(entry.get("shape"), name)
    params = _object(entry.get("parameters"), "parameters")
    present = [f for f in _DATA_FIELDS if (f in entry if f == "data" else f in params)]
    if len(present) != 1:
        got = "no field is set" if not present else "set " + " ".join(f"'{f}'" for f in present)
        raise BadRequest("Input must set only one of the following fields: 'data', 'binary_data_size' in "
                         f"'parameters', 'shared_memory_region' in 'parameters'. But {got}")
    if present[0] == "shared_memory_region":
        raise BadRequest(f"input '{name}': shared memory is not supported by this server")
    if present[0] == "data":
        return tensor_from_json(name, datatype, shape, entry["data"]), offset
    size = params["binary_data_size"]
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise BadRequest("Unable to parse 'binary_data_size'")
    if offset + size > len(rest):
        raise BadRequest(f"unexpected size for input '{name}', expecting {offset + size - len(rest)} "
                         f"additional bytes for model '{model}'")
    return tensor_from_binary(name, datatype, shape, bytes(rest[offset:offset + size]), model), offset + size


def _requested_outputs(raw: Any, model: str, contract: ModelContract) -> tuple[list[str], set[str]]:
    if not isinstance(raw, list):
        raise BadRequest("Unable to parse 'outputs': expected an array")
    names: list[str] = []
    binary: set[str] = set()
    for entry in raw:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise BadRequest("Unable to parse 'outputs': each output needs a string 'name'")
        name, params = entry["name"], _object(entry.get("parameters"), "parameters")
        if name in names:
            raise BadRequest(f"output '{name}' already exists in request")
        if contract.output(name) is None:
            raise BadRequest(f"unexpected inference output '{name}' for model '{model}'")
        if "classification" in params:
            raise BadRequest("the classification extension is not supported by this server")
        if "shared_memory_region" in params:
            raise BadRequest(f"output '{name}': shared memory is not supported by this server")
        if not isinstance(params.get("binary_data", False), bool):
            raise BadRequest("Unable to parse 'binary_data': expected a boolean")
        names.append(name)
        if params.get("binary_data"):
            binary.add(name)
    return names, binary


def _raw_request(body: bytes, model: str, contract: ModelContract) -> InferRequest:
    """IHCL 0: the body is the data of the model's only (required) input; every output is binary."""
    required = [spec for spec in contract.inputs if not spec.optional]
    if len(required) != 1:
        raise BadRequest(f"Raw request must only have 1 input (found 1) to be deduced but got {len(required)} "
                         f"inputs in '{model}' model configuration")
    spec = required[0]
    if spec.datatype == "BYTES":
        if spec.shape not in ((1,), (-1,)):
            raise BadRequest(f"For BYTE datatype raw input '{spec.name}', the model must have input shape [1]")
        import numpy as np

        return InferRequest([WireTensor(spec.name, "BYTES", (1,), np.array([body], dtype=object))])
    variable = [i for i, d in enumerate(spec.shape) if d == -1]
    if len(variable) > 1:
        raise BadRequest(f"The shape of the raw input '{spec.name}' can not be deduced because there are more "
                         "than one variable-sized dimension")
    fixed = prod(d for d in spec.shape if d != -1) * ELEMENT_SIZES[spec.datatype]
    shape = list(spec.shape)
    if variable:
        if fixed == 0 or len(body) % fixed:
            raise BadRequest(f"input byte size mismatch for input '{spec.name}' for model '{model}': "
                             f"{len(body)} bytes is not a multiple of {fixed}")
        shape[variable[0]] = len(body) // fixed
    tensor = _tensor_or_400(lambda: tensor_from_binary(spec.name, spec.datatype, tuple(shape), body, model))
    return InferRequest([tensor])


def _tensor_or_400(build):
    try:
        return build()
    except TensorError as exc:
        raise BadRequest(str(exc)) from None


def json_value_cap(contract: ModelContract) -> int:
    """The values (counted by the body scan) a JSON request for `contract` may hold: its inputs'
    elements as declared, or json_body.MAX_VALUES where a dimension is variable (a larger tensor
    goes as binary data), plus a fixed schema's room for the rest (shapes, outputs, parameters)."""
    shapes = [spec.shape for spec in contract.inputs]
    variable = any(dim < 0 for shape in shapes for dim in shape)
    return (json_body.MAX_VALUES if variable else sum(map(prod, shapes))) + json_body.FIXED_SCHEMA_VALUES


def parse_infer_request(body: bytes, ihcl: str | None, model: str, contract: ModelContract) -> InferRequest:
    json_size = header_length(ihcl, len(body))
    if json_size == 0:
        return _raw_request(body, model, contract)
    json_size = len(body) if json_size is None else json_size
    header = parse_json(body[:json_size], max_values=json_value_cap(contract))
    if not isinstance(header, JsonObject):
        raise BadRequest("failed to parse the request JSON buffer: expected a JSON object")
    request_id = header.get("id", "")
    if not isinstance(request_id, str):
        raise BadRequest("Unable to parse 'id': attempt to access JSON non-string as string")
    entries = header.get("inputs", [])
    if not isinstance(entries, list):
        raise BadRequest("Unable to parse 'inputs': expected an array")
    rest, offset, tensors = memoryview(body)[json_size:], 0, []
    for entry in entries:
        tensor, offset = _tensor_or_400(lambda: _input_tensor(entry, model, rest, offset))
        if any(t.name == tensor.name for t in tensors):
            raise BadRequest(f"input '{tensor.name}' already exists in request")
        tensors.append(tensor)
    if offset != len(rest):
        raise BadRequest(f"unexpected additional input data for model '{model}'")
    parameters = _request_parameters(header.get("parameters"))
    request = InferRequest(tensors, request_id, parameters)
    if "outputs" in header:
        request.requested_outputs, request.binary_outputs = _requested_outputs(header["outputs"], model, contract)
    elif not parameters.get("binary_data_output"):
        request.all_json = True
    return request


def infer_response(model: str, request: InferRequest, outputs: list[WireTensor]) -> Response:
    """JSON header (+ binary outputs after it), compressed per Accept-Encoding."""
    entries, blobs = [], []
    for tensor in outputs:
        entry = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        binary = not request.all_json and (request.binary_outputs is None or tensor.name in request.binary_outputs)
        if binary:
            blob = tensor_to_binary(tensor)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = _tensor_or_400(lambda: tensor_to_json_data(tensor))
        entries.append(entry)
    header = {**({"id": request.request_id} if request.request_id else {}), "model_name": model,
              "model_version": MODEL_VERSION, "outputs": entries}
    header_bytes = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    headers = {}
    if blobs:
        headers["Inference-Header-Content-Length"] = str(len(header_bytes))
    body, encoding = compress_for_client(header_bytes + b"".join(blobs))
    if encoding:
        headers["Content-Encoding"] = encoding
    mimetype = "application/octet-stream" if blobs else "application/json"
    return Response(body, mimetype=mimetype, headers=headers)
