"""Wire tensors of the KServe v2 / Triton protocol: JSON `data` and binary buffers <-> numpy.

Binary layout (the binary tensor data extension): numeric tensors are little-endian, row-major,
unpadded; BOOL is one byte per element (any non-zero byte reads as true); BYTES elements are each a
4-byte little-endian length followed by that many bytes (NULs allowed, UTF-8 not required); BF16 is
the top two bytes of the little-endian float32 (numpy has no bfloat16, so BF16 lives as float32 here).

Every error raises TensorError with Triton's wording; the caller decides the status (always 400).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from math import prod

import numpy as np

# protocol name -> numpy dtype (little-endian) of one element; BYTES elements are Python bytes.
NUMPY_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "UINT8": np.dtype("<u1"), "UINT16": np.dtype("<u2"), "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"), "INT8": np.dtype("<i1"), "INT16": np.dtype("<i2"), "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"), "FP16": np.dtype("<f2"), "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
    "BF16": np.dtype("<f4"), "BYTES": np.dtype(object),
}
ELEMENT_SIZES = {name: (2 if name == "BF16" else dtype.itemsize) for name, dtype in NUMPY_DTYPES.items()
                 if name != "BYTES"}
_MAX_INT64 = 2**63 - 1
_JSON_ONLY_BINARY = ("FP16", "BF16")  # Triton refuses these in JSON both ways


class TensorError(ValueError):
    """A tensor that does not fit its declared datatype or shape; the message is Triton's."""


@dataclass
class WireTensor:
    """One named tensor as it travels: protocol datatype, shape, and the values as numpy."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    array: np.ndarray

    @property
    def element_count(self) -> int:
        return prod(self.shape)


def check_datatype(datatype: object, name: str) -> str:
    if not isinstance(datatype, str) or datatype not in NUMPY_DTYPES:
        raise TensorError(f"invalid datatype '{datatype}' for input '{name}'; expected one of {sorted(NUMPY_DTYPES)}")
    return datatype


def parse_shape(shape: object, name: str) -> tuple[int, ...]:
    """A request shape: a list of non-negative integers whose element count fits in int64."""
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise TensorError(f"Unable to parse 'shape' of input '{name}': expected an array of unsigned integers")
    if any(d < 0 for d in shape):
        raise TensorError(f"Unable to parse 'shape' of input '{name}': dimensions must be >= 0, got {shape}")
    if any(d > _MAX_INT64 for d in shape):  # Triton's dims are int64 (and numpy's too)
        raise TensorError(f"Unable to parse 'shape' of input '{name}': dimensions must be <= {_MAX_INT64}, "
                          f"got {shape}")
    if prod(shape) > _MAX_INT64:
        raise TensorError(f"Unable to parse 'shape': shape {shape} of input '{name}' causes total element count "
                          f"to exceed maximum size of {_MAX_INT64}")
    return tuple(shape)


def byte_size(datatype: str, shape: tuple[int, ...], name: str) -> int:
    """Bytes a fixed-size tensor occupies; BYTES has no fixed size (None is never returned for others)."""
    size = prod(shape) * ELEMENT_SIZES[datatype]
    if size > _MAX_INT64:
        raise TensorError(f"byte size overflow for input '{name}'")
    return size


# --- JSON `data` ---------------------------------------------------------------------------------

def _flatten(data: object) -> list:
    """Row-major elements of nested or flat JSON arrays (a bare scalar is one element)."""
    if not isinstance(data, list):
        return [data]
    flat: list = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
    return flat


def _check_json_element(datatype: str, value: object) -> None:
    if datatype == "BYTES":
        if not isinstance(value, str):
            raise TensorError("Unable to parse 'data': attempt to access JSON non-string as string")
    elif datatype == "BOOL":
        if not isinstance(value, bool):
            raise TensorError("Unable to parse 'data': attempt to access JSON non-boolean as boolean")
    elif datatype.startswith("UINT"):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise TensorError("Unable to parse 'data': attempt to access JSON non-unsigned-integer as unsigned integer")
    elif datatype.startswith("INT"):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TensorError("Unable to parse 'data': attempt to access JSON non-signed-integer as signed integer")
    elif not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TensorError("Unable to parse 'data': attempt to access JSON non-number as double")


def values_to_array(datatype: str, values: list, name: str) -> np.ndarray:
    """A flat numpy array from JSON scalars already known to be of the right count."""
    for value in values:
        _check_json_element(datatype, value)
    if datatype == "BYTES":
        return np.array([v.encode("utf-8") for v in values] or [], dtype=object)
    try:
        return np.array(values, dtype=NUMPY_DTYPES[datatype])
    except OverflowError:
        raise TensorError(f"Unable to parse 'data': a value of input '{name}' is out of range for {datatype}") from None


def tensor_from_json(name: str, datatype: str, shape: tuple[int, ...], data: object) -> WireTensor:
    """`data` (nested or flat, row-major) must hold exactly prod(shape) elements."""
    if datatype in _JSON_ONLY_BINARY:
        raise TensorError(f"receiving {datatype} data via JSON is not supported. Please use the binary data "
                          f"format for input {name}")
    if datatype != "BYTES":
        byte_size(datatype, shape, name)  # an overflowing shape is named as such, before counting `data`
    flat = _flatten(data)
    expected = prod(shape)
    if len(flat) < expected:
        raise TensorError("Failed to parse 'data' field: shape does not match true shape")
    if len(flat) > expected:
        raise TensorError("Unable to parse 'data': Shape does not match true shape of 'data' field")
    return WireTensor(name, datatype, shape, values_to_array(datatype, flat, name).reshape(shape))


def tensor_to_json_data(tensor: WireTensor) -> list:
    """The flat JSON `data` list of an output (BYTES as UTF-8 strings, undecodable bytes replaced)."""
    if tensor.datatype in _JSON_ONLY_BINARY:
        raise TensorError(f"sending {tensor.datatype} data via JSON is not supported. Please use the binary "
                          f"data format for output {tensor.name}")
    flat = tensor.array.reshape(-1)
    if tensor.datatype == "BYTES":
        return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in flat]
    return flat.tolist()


# --- binary buffers ------------------------------------------------------------------------------

def deserialize_bytes(raw: bytes, count: int, name: str, model: str) -> np.ndarray:
    """`count` length-prefixed elements, no more and no fewer."""
    elements, offset = [], 0
    while offset < len(raw):
        if len(elements) == count:
            extra = count + 1
            raise TensorError(f"unexpected number of string elements {extra} for inference input '{name}' for "
                              f"model '{model}', expecting {count}")
        if offset + 4 > len(raw):
            break
        (length,) = struct.unpack_from("<I", raw, offset)
        if offset + 4 + length > len(raw):
            break
        elements.append(raw[offset + 4:offset + 4 + length])
        offset += 4 + length
    if len(elements) != count or offset != len(raw):
        raise TensorError(f"expected {count} string elements for inference input '{name}' for model '{model}', "
                          f"got {len(elements)}")
    return np.array(elements or [], dtype=object)


def serialize_bytes(array: np.ndarray) -> bytes:
    parts = []
    for value in array.reshape(-1):
        data = value if isinstance(value, bytes) else str(value).encode("utf-8")
        parts.append(struct.pack("<I", len(data)))
        parts.append(data)
    return b"".join(parts)


def tensor_from_binary(name: str, datatype: str, shape: tuple[int, ...], raw: bytes, model: str) -> WireTensor:
    if datatype == "BYTES":
        return WireTensor(name, datatype, shape, deserialize_bytes(raw, prod(shape), name, model).reshape(shape))
    expected = byte_size(datatype, shape, name)
    if len(raw) != expected:
        raise TensorError(f"input byte size mismatch for input '{name}' for model '{model}'. Expected {expected}, "
                          f"got {len(raw)}")
    if datatype == "BF16":
        halves = np.frombuffer(raw, dtype="<u2").astype("<u4") << 16
        array = halves.view("<f4")
    elif datatype == "BOOL":
        array = np.frombuffer(raw, dtype=np.uint8) != 0
    else:
        array = np.frombuffer(raw, dtype=NUMPY_DTYPES[datatype]).copy()
    return WireTensor(name, datatype, shape, array.reshape(shape))


def tensor_to_binary(tensor: WireTensor) -> bytes:
    if tensor.datatype == "BYTES":
        return serialize_bytes(tensor.array)
    if tensor.datatype == "BF16":
        return (np.ascontiguousarray(tensor.array, dtype="<f4").view("<u4") >> 16).astype("<u2").tobytes()
    return np.ascontiguousarray(tensor.array, dtype=NUMPY_DTYPES[tensor.datatype]).tobytes()


def datatype_of(array: np.ndarray) -> str | None:
    """The protocol datatype a numpy array naturally has (None when there is none)."""
    if array.dtype == object or array.dtype.kind in ("S", "U"):
        return "BYTES"
    for name, dtype in NUMPY_DTYPES.items():
        if name not in ("BF16", "BYTES") and array.dtype.newbyteorder("<") == dtype:
            return name
    return None


def as_wire_tensor(name: str, datatype: str, array: np.ndarray) -> WireTensor:
    """A model's output array as a tensor of its declared datatype (BYTES: str items become UTF-8)."""
    if datatype == "BYTES":
        flat = [v if isinstance(v, bytes) else str(v).encode("utf-8") for v in np.asarray(array).reshape(-1)]
        shape = tuple(np.shape(array))
        return WireTensor(name, datatype, shape, np.array(flat or [], dtype=object).reshape(shape))
    return WireTensor(name, datatype, tuple(array.shape), np.asarray(array, dtype=NUMPY_DTYPES[datatype]))
