"""Wire tensors: JSON `data` and binary buffers <-> numpy, with Triton's error messages."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from lmi_serve.tensors import (TensorError, WireTensor, as_wire_tensor, datatype_of, parse_shape,
                                               serialize_bytes, tensor_from_binary, tensor_from_json,
                                               tensor_to_binary, tensor_to_json_data)


def test_json_data_may_be_nested_or_flat():
    nested = tensor_from_json("X", "INT32", (2, 2), [[1, 2], [4, 5]])
    flat = tensor_from_json("X", "INT32", (2, 2), [1, 2, 4, 5])
    assert nested.array.tolist() == flat.array.tolist() == [[1, 2], [4, 5]]
    assert nested.array.dtype == np.int32


def test_json_element_count_mismatch_uses_triton_messages():
    with pytest.raises(TensorError, match=r"^Failed to parse 'data' field: shape does not match true shape$"):
        tensor_from_json("X", "INT32", (1, 16), list(range(15)))
    with pytest.raises(TensorError,
                       match=r"^Unable to parse 'data': Shape does not match true shape of 'data' field$"):
        tensor_from_json("X", "INT32", (1, 16), list(range(18)))


@pytest.mark.parametrize("datatype, value, accessor", [
    ("BYTES", 123, "non-string as string"),
    ("BOOL", 1, "non-boolean as boolean"),
    ("INT32", 1.5, "non-signed-integer as signed integer"),
    ("INT8", True, "non-signed-integer as signed integer"),
    ("UINT8", -1, "non-unsigned-integer as unsigned integer"),
    ("FP32", "1.0", "non-number as double"),
])
def test_json_elements_must_have_the_datatype_json_type(datatype, value, accessor):
    with pytest.raises(TensorError, match=f"attempt to access JSON {accessor}"):
        tensor_from_json("X", datatype, (1,), [value])


def test_json_integers_out_of_range_are_refused_not_wrapped():
    with pytest.raises(TensorError, match="out of range for INT8"):
        tensor_from_json("X", "INT8", (1,), [300])


@pytest.mark.parametrize("datatype", ["FP16", "BF16"])
def test_half_floats_travel_only_in_binary(datatype):
    with pytest.raises(TensorError, match=f"receiving {datatype} data via JSON is not supported. Please use the "
                                          "binary data format for input X"):
        tensor_from_json("X", datatype, (1,), [1.0])
    tensor = tensor_from_binary("Y", datatype, (2,), tensor_to_binary(
        WireTensor("Y", datatype, (2,), np.array([1.5, -2.0], dtype=np.float32))), "m")
    assert tensor.array.tolist() == [1.5, -2.0]
    with pytest.raises(TensorError, match=f"sending {datatype} data via JSON is not supported"):
        tensor_to_json_data(tensor)


@pytest.mark.parametrize("datatype, values", [
    ("BOOL", [True, False, True]), ("UINT8", [0, 255, 7]), ("UINT16", [1, 65535, 3]), ("UINT32", [1, 2, 3]),
    ("UINT64", [1, 2**63, 3]), ("INT8", [-128, 127, 0]), ("INT16", [-1, 2, 3]), ("INT32", [-5, 6, 7]),
    ("INT64", [-(2**62), 2, 3]), ("FP32", [1.5, -2.25, 0.0]), ("FP64", [1e-300, 2.0, 3.0]),
])
def test_every_numeric_datatype_round_trips_through_binary_and_json(datatype, values):
    tensor = tensor_from_json("X", datatype, (3,), values)
    raw = tensor_to_binary(tensor)
    assert len(raw) == 3 * (1 if datatype in ("BOOL", "UINT8", "INT8") else tensor.array.itemsize)
    back = tensor_from_binary("X", datatype, (3,), raw, "m")
    assert tensor_to_json_data(back) == values


def test_binary_is_little_endian_and_bool_is_one_byte():
    assert tensor_to_binary(tensor_from_json("X", "INT32", (2,), [1, 256])) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    assert tensor_to_binary(tensor_from_json("X", "BOOL", (2,), [True, False])) == b"\x01\x00"
    assert tensor_from_binary("X", "BOOL", (1,), b"\x07", "m").array.tolist() == [True]  # non-zero reads as true


def test_bf16_is_the_top_two_bytes_of_fp32():
    raw = struct.pack("<f", 1.5)[2:]
    assert tensor_from_binary("X", "BF16", (1,), raw, "m").array.tolist() == [1.5]


def test_bytes_elements_are_length_prefixed_and_keep_nuls():
    array = np.array([b"abc\0def", "h\u00e9llo", b""], dtype=object)
    raw = serialize_bytes(array)
    assert raw[:4] == struct.pack("<I", 7) and raw[4:11] == b"abc\0def"
    back = tensor_from_binary("T", "BYTES", (3,), raw, "m")
    assert back.array.tolist() == [b"abc\0def", "h\u00e9llo".encode(), b""]
    assert tensor_to_json_data(back) == ["abc\0def", "h\u00e9llo", ""]


def test_bytes_element_count_mismatch_uses_triton_messages():
    raw = serialize_bytes(np.array([b"x"] * 14, dtype=object))
    with pytest.raises(TensorError, match=r"^expected 16 string elements for inference input 'IN' for model 'm', "
                                          r"got 14$"):
        tensor_from_binary("IN", "BYTES", (16,), raw, "m")
    raw = serialize_bytes(np.array([b"x"] * 17, dtype=object))
    with pytest.raises(TensorError, match=r"^unexpected number of string elements 17 for inference input 'IN' for "
                                          r"model 'm', expecting 16$"):
        tensor_from_binary("IN", "BYTES", (16,), raw, "m")


def test_fixed_size_binary_must_match_shape_times_element_size():
    with pytest.raises(TensorError, match=r"^input byte size mismatch for input 'I' for model 'pt'. Expected 32, "
                                          r"got 40$"):
        tensor_from_binary("I", "FP32", (8,), b"\0" * 40, "pt")


def test_shapes_are_unsigned_and_bounded():
    assert parse_shape([2, 3], "X") == (2, 3)
    with pytest.raises(TensorError, match="dimensions must be >= 0"):
        parse_shape([2, -5], "X")
    with pytest.raises(TensorError, match="causes total element count to exceed maximum size of"):
        parse_shape([2**4, 2**60 + 2], "X")
    with pytest.raises(TensorError, match="expected an array of unsigned integers"):
        parse_shape("2", "X")


def test_numpy_arrays_map_to_their_natural_datatype():
    assert datatype_of(np.zeros(2, dtype=np.int32)) == "INT32"
    assert datatype_of(np.zeros(2, dtype=">i4")) == "INT32"
    assert datatype_of(np.array(["a"])) == "BYTES"
    assert datatype_of(np.zeros(2, dtype=np.complex64)) is None
    assert as_wire_tensor("T", "BYTES", np.array([["a", "b"]])).array.tolist() == [[b"a", b"b"]]
