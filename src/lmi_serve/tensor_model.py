"""How a custom `model.py` serves tensors on the KServe v2 / Triton routes (see docs/triton.md, "Tensor models").

A model.py declares its tensors at module level and keeps DJL's `handle(Input) -> Output`:

    INPUT_TENSORS = [TensorSpec("INPUT0", "INT32", [-1, 16]), TensorSpec("INPUT1", "INT32", [-1, 16])]
    OUTPUT_TENSORS = [TensorSpec("OUTPUT0", "INT32", [-1, 16]), TensorSpec("OUTPUT1", "INT32", [-1, 16])]

    def handle(inputs):
        ...
        tensors = get_tensors(item)                          # {"INPUT0": np.ndarray, ...}
        add_tensors(output, {"OUTPUT0": a + b, ...}, batch_index=...)

The server checks every request against INPUT_TENSORS (names, datatypes, shapes) before `handle`
runs, and every output against OUTPUT_TENSORS after. On other routes (/invocations, /predictions)
`get_tensors` refuses content that is no tensor, and asking it for a missing tensor raises a
InvalidRequest (400) naming it, so a handler needs no checks of its own. Each tensor travels inside
the Input/Output as one content entry named after the tensor, in an encoding of our own (a JSON
header line, then the binary tensor data): never pickle, so a body sent to /invocations cannot
smuggle objects in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from lmi_serve.errors import InvalidRequest
from lmi_serve.handler_api import DATA_KEY, Input, Output
from lmi_serve.tensors import (NUMPY_DTYPES, WireTensor, as_wire_tensor, check_datatype, datatype_of,
                      tensor_from_binary, tensor_to_binary)

_MAGIC = b'{"tensor":'
_ROUTES_HINT = "tensor models are served on the /v2/models/<model>/infer and /generate routes"


class TensorRequestError(InvalidRequest, ValueError):
    """The request does not carry the tensors a tensor model needs (a client error, 400); still a
    ValueError, as get_tensors raised before."""


class MissingTensor(TensorRequestError, KeyError):
    """`get_tensors(...)[name]` for a tensor the request lacks; still a KeyError for handlers that catch one."""

    def __str__(self) -> str:  # KeyError would show the message quoted
        return self.message


class Tensors(dict):
    """The request's tensors by name; asking for one it lacks raises MissingTensor naming it."""

    def __missing__(self, name: str) -> np.ndarray:
        given = ", ".join(f"'{key}'" for key in self) or "none"
        raise MissingTensor(f"input tensor '{name}' is missing from the request (tensors given: {given}); "
                            f"{_ROUTES_HINT}")


@dataclass(frozen=True)
class TensorSpec:
    """One declared tensor. `shape` is what model metadata shows: -1 marks a variable dimension."""

    name: str
    datatype: str
    shape: tuple[int, ...] = field(default=(-1,))
    optional: bool = False

    def __post_init__(self) -> None:
        check_datatype(self.datatype, self.name)
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))


def encode_tensor(tensor: WireTensor) -> bytes:
    header = json.dumps({"tensor": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)})
    return header.encode("utf-8") + b"\n" + tensor_to_binary(tensor)


def decode_tensor(key: str, value: bytes) -> WireTensor:
    """One content entry as a tensor; raises ValueError for anything else."""
    header, _, raw = value.partition(b"\n")
    meta = json.loads(header) if value.startswith(_MAGIC) else None  # JSONDecodeError is a ValueError
    if not isinstance(meta, dict):
        raise ValueError(f"content entry '{key}' is not a tensor: {_ROUTES_HINT}")
    datatype = check_datatype(meta.get("datatype"), key)
    shape = meta.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"content entry '{key}' has no valid tensor shape")
    return tensor_from_binary(str(meta.get("tensor")), datatype, tuple(shape), raw, "model")


def _request_tensor(key: str, value: bytes) -> np.ndarray:
    """A request's content entry as a tensor: anything else (a body or query parameter sent to
    /invocations or /predictions) is the client's mistake."""
    try:
        return decode_tensor(key, value).array
    except ValueError:  # TensorError is a ValueError too
        raise TensorRequestError(f"content entry '{key}' is not a tensor: {_ROUTES_HINT}") from None


def tensor_input(tensors: list[WireTensor], properties: dict[str, str]) -> Input:
    """The Input a tensor model's handle() receives for one request."""
    request = Input(properties)
    for tensor in tensors:
        request.content.add(tensor.name, encode_tensor(tensor))
    return request


def get_tensors(inputs: Input) -> Tensors:
    """The request's tensors by name, as numpy arrays (BYTES: object arrays of `bytes`). A missing
    tensor or a content entry that is no tensor raises a InvalidRequest (400) naming it, so a handler
    that indexes `tensors["INPUT0"]` answers the client instead of failing with a KeyError."""
    return Tensors((key, _request_tensor(key, bytes(value))) for key, value in inputs.content if key != DATA_KEY)


def add_tensors(output: Output, tensors: dict[str, np.ndarray], batch_index: int | None = None) -> Output:
    """Add output tensors (numpy arrays, or anything numpy turns into one) to `output`."""
    for name, value in tensors.items():
        array = np.asarray(value)
        datatype = datatype_of(array)
        if datatype is None:
            raise ValueError(f"output '{name}': numpy dtype {array.dtype} has no KServe v2 datatype")
        output.add(encode_tensor(as_wire_tensor(name, datatype, array)), key=name, batch_index=batch_index)
    output.add_property("Content-Type", "application/x-lmi-serve-tensors")
    return output


def read_output_tensors(output: Output, specs: list[TensorSpec], model: str) -> list[WireTensor]:
    """The tensors a handle() returned, in the order it added them, checked against its declaration."""
    declared = {spec.name: spec for spec in specs}
    tensors = []
    for key, value in output.content:
        tensor = decode_tensor(key, bytes(value))
        spec = declared.get(tensor.name)
        if spec is None:
            raise ValueError(f"model '{model}' returned output '{tensor.name}', which OUTPUT_TENSORS does not declare")
        if spec.datatype != tensor.datatype:
            if spec.datatype == "BF16" or NUMPY_DTYPES[spec.datatype].kind != NUMPY_DTYPES[tensor.datatype].kind:
                raise ValueError(f"model '{model}' returned output '{tensor.name}' as {tensor.datatype}, but declares "
                                 f"{spec.datatype}")
            cast = as_wire_tensor(tensor.name, spec.datatype, tensor.array)  # e.g. numpy's int64 sums for INT32
            narrowed = cast.array.dtype.kind in "iub" and not np.array_equal(cast.array, tensor.array)
            if spec.datatype != "BYTES" and narrowed:
                raise ValueError(f"model '{model}' returned output '{tensor.name}' with values out of range for "
                                 f"its declared {spec.datatype}")
            tensor = cast
        tensors.append(tensor)
    return tensors
