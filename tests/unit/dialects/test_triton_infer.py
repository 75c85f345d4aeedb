"""/infer bodies without a model: IHCL splitting, JSON+binary inputs, output selection, raw requests,
response layout and compression, and the checks of inputs against a model's contract."""

from __future__ import annotations

import gzip
import json
import zlib

import numpy as np
import pytest
from flask import Flask

from lmi_serve import json_body, json_scan
from lmi_serve.dialects.triton.infer import infer_response, json_value_cap, parse_infer_request
from lmi_serve.dialects.triton.llm import LLM_INPUTS, LLM_OUTPUTS
from lmi_serve.dialects.triton.models import ModelContract, validate_inputs
from lmi_serve.dialects.triton.protocol import TritonError, parse_json, read_body
from lmi_serve.tensor_model import TensorSpec
from lmi_serve.tensors import WireTensor, serialize_bytes

SIMPLE = ModelContract("tensor", (TensorSpec("INPUT0", "INT32", (-1, 16)), TensorSpec("INPUT1", "INT32", (-1, 16))),
                       (TensorSpec("OUTPUT0", "INT32", (-1, 16)), TensorSpec("OUTPUT1", "INT32", (-1, 16))))
LLM = ModelContract("llm", LLM_INPUTS, LLM_OUTPUTS, lenient_single_elements=True)
EMBED = ModelContract("embedding", (TensorSpec("text_input", "BYTES", (-1,)),),
                      (TensorSpec("embedding", "FP32", (-1, 384)),))
ONES = np.ones(16, dtype=np.int32)


def body_with(header: dict, *blobs: bytes) -> tuple[bytes, str]:
    data = json.dumps(header).encode()
    return data + b"".join(blobs), str(len(data))


def simple_inputs(input1: dict | None = None) -> list[dict]:
    return [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
            input1 or {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32",
                       "parameters": {"binary_data_size": 64}}]


def test_json_and_binary_inputs_mix_in_one_request():
    body, ihcl = body_with({"id": "7", "inputs": simple_inputs()}, ONES.tobytes())
    parsed = parse_infer_request(body, ihcl, "simple", SIMPLE)
    assert parsed.request_id == "7"
    assert [t.name for t in parsed.inputs] == ["INPUT0", "INPUT1"]
    assert parsed.inputs[0].array.tolist() == [list(range(16))] and parsed.inputs[1].array.sum() == 16
    assert parsed.all_json  # no outputs and no binary_data_output: JSON outputs


def test_binary_inputs_consume_the_body_in_inputs_order():
    header = {"inputs": [{"name": "B", "shape": [2], "datatype": "BYTES", "parameters": {"binary_data_size": 13}},
                         {"name": "A", "shape": [1], "datatype": "INT8", "parameters": {"binary_data_size": 1}}]}
    contract = ModelContract("tensor", (TensorSpec("A", "INT8", (1,)), TensorSpec("B", "BYTES", (2,))), ())
    body, ihcl = body_with(header, serialize_bytes(np.array([b"abc", b"\0\0"], dtype=object)), b"\x05")
    parsed = parse_infer_request(body, ihcl, "m", contract)
    assert parsed.inputs[0].array.tolist() == [b"abc", b"\0\0"] and parsed.inputs[1].array.tolist() == [5]


@pytest.mark.parametrize("extra, message", [
    (b"", "unexpected size for input 'INPUT1', expecting 4 additional bytes for model 'simple'"),
    (b"\0" * 8, "unexpected additional input data for model 'simple'"),
])
def test_binary_sizes_must_add_up(extra, message):
    blob = ONES.tobytes()[:60] if not extra else ONES.tobytes() + extra
    body, ihcl = body_with({"inputs": simple_inputs()}, blob)
    with pytest.raises(TritonError, match=message):
        parse_infer_request(body, ihcl, "simple", SIMPLE)


@pytest.mark.parametrize("ihcl, message", [
    ("abc", "Unable to parse Inference-Header-Content-Length, got: abc"),
    ("99999999999", "Unable to parse Inference-Header-Content-Length, got: 99999999999"),
    ("-1", r"inference header size should be in range \(0, 10\), got: -1"),
    ("11", r"inference header size should be in range \(0, 10\), got: 11"),
])
def test_inference_header_length_is_checked(ihcl, message):
    with pytest.raises(TritonError, match=message) as caught:
        parse_infer_request(b"0123456789", ihcl, "simple", SIMPLE)
    assert caught.value.status == 400


@pytest.mark.parametrize("entry, got", [
    ({"name": "INPUT1", "shape": [1, 16], "datatype": "INT32"}, "But no field is set"),
    ({"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16,
      "parameters": {"binary_data_size": 64}}, "But set 'data' 'binary_data_size'"),
])
def test_an_input_sets_exactly_one_data_field(entry, got):
    body, ihcl = body_with({"inputs": simple_inputs(entry)})
    with pytest.raises(TritonError, match="Input must set only one of the following fields: 'data', "
                                          "'binary_data_size' in 'parameters', 'shared_memory_region' in "
                                          f"'parameters'. {got}"):
        parse_infer_request(body, ihcl, "simple", SIMPLE)


def test_duplicate_inputs_and_outputs_and_unknown_outputs_are_refused():
    twice = simple_inputs(simple_inputs()[0])
    with pytest.raises(TritonError, match="input 'INPUT0' already exists in request"):
        parse_infer_request(json.dumps({"inputs": twice}).encode(), None, "simple", SIMPLE)
    for outputs, message in ([[{"name": "OUTPUT0"}, {"name": "OUTPUT0"}], "output 'OUTPUT0' already exists in request"],
                             [[{"name": "OUTPUT9"}], "unexpected inference output 'OUTPUT9' for model 'simple'"]):
        header = {"inputs": simple_inputs(simple_inputs()[0] | {"name": "INPUT1"}), "outputs": outputs}
        with pytest.raises(TritonError, match=message):
            parse_infer_request(json.dumps(header).encode(), None, "simple", SIMPLE)


@pytest.mark.parametrize("parameters, message", [
    ({"triton_x": 1}, "parameter keys starting with 'triton_' are reserved"),
    ({"PARAMS": {"a": 1}}, "parameter 'PARAMS' has invalid type. It should be either 'int', 'bool', or 'string'."),
])
def test_request_parameters_are_scalars_and_not_reserved(parameters, message):
    header = {"inputs": simple_inputs(simple_inputs()[0] | {"name": "INPUT1"}), "parameters": parameters}
    with pytest.raises(TritonError, match=message):
        parse_infer_request(json.dumps(header).encode(), None, "simple", SIMPLE)


def test_json_nesting_is_capped_at_100():
    assert parse_json(b"[" * 50 + b"]" * 50) is not None
    with pytest.raises(TritonError, match=r"JSON nesting depth exceeds maximum allowed limit \(100\)"):
        parse_json(b"[" * 120 + b"]" * 120)
    with pytest.raises(TritonError, match=r"JSON nesting depth exceeds maximum allowed limit \(100\)"):
        parse_json(b"[" * 100000 + b"]" * 100000)


def test_json_tensors_are_capped_by_the_declared_shapes_before_decoding(monkeypatch):
    """A model whose every dimension is fixed takes its inputs' elements and a fixed schema's room
    for the rest; one with a variable dimension json_body.MAX_VALUES (larger tensors go binary)."""
    room = json_body.FIXED_SCHEMA_VALUES
    fixed = ModelContract("tensor", (TensorSpec("A", "INT32", (2, 3)), TensorSpec("B", "FP32", (4,))), ())
    assert json_value_cap(fixed) == 10 + room
    assert json_value_cap(SIMPLE) == json_value_cap(EMBED) == json_body.MAX_VALUES + room
    inputs = [{"name": "A", "shape": [2, 3], "datatype": "INT32", "data": [[1, 2, 3], [4, 5, 6]]},
              {"name": "B", "shape": [4], "datatype": "FP32", "data": [0.5] * 4}]
    header = {"inputs": inputs, "parameters": {"p": 1}}
    values = json_scan.scan(json.dumps(header).encode()).commas + 1  # names, shapes... and 10 elements
    header["padding"] = [0] * (json_value_cap(fixed) - values)
    at_cap = json.dumps(header).encode()
    assert json_scan.scan(at_cap).commas + 1 == json_value_cap(fixed)
    assert parse_json(at_cap, max_values=json_value_cap(fixed))["parameters"] == {"p": 1}
    monkeypatch.setattr(json_body.json, "loads", lambda *a, **k: pytest.fail("decoded"))
    over = at_cap.replace(b'"p": 1', b'"p": 1, "q": 2')
    with pytest.raises(json_body.InvalidJson, match=f"at least {json_value_cap(fixed) + 1:,} values in its arrays "
                                                    f"and objects; this route takes at most {json_value_cap(fixed):,}"):
        parse_infer_request(over, None, "m", fixed)


def test_raw_requests_need_one_required_input():
    parsed = parse_infer_request(b"The capital", "0", "llm", LLM)
    assert parsed.inputs[0].name == "text_input" and parsed.inputs[0].array.tolist() == [b"The capital"]
    assert parsed.binary_outputs is None and not parsed.all_json  # every output binary
    with pytest.raises(TritonError, match="Raw request must only have 1 input \\(found 1\\) to be deduced but got 2 "
                                          "inputs in 'simple' model configuration"):
        parse_infer_request(b"\0" * 64, "0", "simple", SIMPLE)
    fp32 = ModelContract("tensor", (TensorSpec("IN", "FP32", (-1,)),), ())
    assert parse_infer_request(np.arange(8, dtype=np.float32).tobytes(), "0", "m", fp32).inputs[0].shape == (8,)
    two_variable = ModelContract("tensor", (TensorSpec("IN", "FP16", (-1, -1)),), ())
    with pytest.raises(TritonError, match="more than one variable-sized dimension"):
        parse_infer_request(b"\0" * 8, "0", "m", two_variable)
    wide_bytes = ModelContract("tensor", (TensorSpec("IN", "BYTES", (2,)),), ())
    with pytest.raises(TritonError, match="For BYTE datatype raw input 'IN', the model must have input shape \\[1\\]"):
        parse_infer_request(b"x", "0", "m", wide_bytes)


def test_inputs_are_checked_against_the_contract_in_tritons_words():
    a = WireTensor("INPUT0", "INT32", (1, 16), ONES)
    with pytest.raises(TritonError, match=r"^expected 2 inputs but got 1 inputs for model 'simple'. Got input\(s\) "
                                          r"\['INPUT0'\], but missing required input\(s\) \['INPUT1'\]. Please "
                                          r"provide all required input\(s\).$"):
        validate_inputs("simple", SIMPLE, [a])
    with pytest.raises(TritonError, match="expected number of inputs between 1 and 12 but got 0 inputs"):
        validate_inputs("llm", LLM, [])
    with pytest.raises(TritonError, match="unexpected inference input 'INPUT9' for model 'simple'"):
        validate_inputs("simple", SIMPLE, [a, WireTensor("INPUT9", "INT32", (1, 16), ONES)])
    with pytest.raises(TritonError, match="inference input 'INPUT1' data-type is 'FP32', but model 'simple' "
                                          "expects 'INT32'"):
        validate_inputs("simple", SIMPLE, [a, WireTensor("INPUT1", "FP32", (1, 16), ONES)])
    with pytest.raises(TritonError, match=r"unexpected shape for input 'INPUT1' for model 'simple'. Expected "
                                          r"\[-1,16\], got \[16\]"):
        validate_inputs("simple", SIMPLE, [a, WireTensor("INPUT1", "INT32", (16,), ONES)])


def test_llm_single_element_inputs_accept_any_rank():
    prompt = np.array([[b"hi"]], dtype=object)
    assert validate_inputs("llm", LLM, [WireTensor("text_input", "BYTES", (1, 1), prompt)])
    with pytest.raises(TritonError, match="unexpected shape for input 'text_input'"):
        validate_inputs("llm", LLM, [WireTensor("text_input", "BYTES", (2,), np.array([b"a", b"b"], dtype=object))])
    assert validate_inputs("e", EMBED, [WireTensor("text_input", "BYTES", (2,), np.array([b"a", b"b"], dtype=object))])


OUTPUTS = [WireTensor("OUTPUT0", "INT32", (1, 16), ONES.reshape(1, 16)),
           WireTensor("OUTPUT1", "INT32", (1, 16), np.zeros((1, 16), dtype=np.int32))]


def respond(header: dict, accept_encoding: str = "identity"):
    app = Flask(__name__)
    with app.test_request_context(headers={"Accept-Encoding": accept_encoding}):
        body, ihcl = body_with(header)
        parsed = parse_infer_request(body, None, "simple", SIMPLE)
        return infer_response("simple", parsed, OUTPUTS)


def test_outputs_are_binary_exactly_as_triton_decides():
    inputs = simple_inputs(simple_inputs()[0] | {"name": "INPUT1"})
    cases = [({}, set()),  # no outputs: JSON
             ({"parameters": {"binary_data_output": True}}, {"OUTPUT0", "OUTPUT1"}),
             ({"outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}, {"name": "OUTPUT1"}]},
              {"OUTPUT0"}),
             # binary_data_output applies only when outputs are omitted (Triton's QA, test.sh case 5)
             ({"parameters": {"binary_data_output": True},
               "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": False}}, {"name": "OUTPUT1"}]}, set())]
    for extra, binary in cases:
        response = respond({"inputs": inputs, **extra})
        raw = response.get_data()
        ihcl = response.headers.get("Inference-Header-Content-Length")
        header = json.loads(raw[:int(ihcl)] if ihcl else raw)
        got = {o["name"] for o in header["outputs"] if "parameters" in o}
        assert got == binary, extra
        assert response.mimetype == ("application/octet-stream" if binary else "application/json")
        assert len(raw) - (int(ihcl) if ihcl else len(raw)) == 64 * len(binary)


def test_responses_compress_by_accept_encoding_and_ihcl_counts_the_plain_json():
    header = {"inputs": simple_inputs(simple_inputs()[0] | {"name": "INPUT1"}),
              "parameters": {"binary_data_output": True}}
    plain = respond(header)
    for accept, encoding, decompress in (("gzip, deflate", "gzip", gzip.decompress),
                                         ("deflate", "deflate", zlib.decompress),
                                         ("gzip;q=0.5, deflate;q=0.9", "deflate", zlib.decompress)):
        response = respond(header, accept)
        assert response.headers["Content-Encoding"] == encoding
        assert decompress(response.get_data()) == plain.get_data()
        assert response.headers["Inference-Header-Content-Length"] == plain.headers["Inference-Header-Content-Length"]
    assert "Content-Encoding" not in respond(header, "br").headers


def test_request_bodies_decompress_by_content_encoding():
    app = Flask(__name__)
    payload = b'{"inputs": []}'
    for encoding, data in (("gzip", gzip.compress(payload)), ("deflate", zlib.compress(payload)),
                           ("identity", payload)):
        with app.test_request_context(method="POST", data=data, headers={"Content-Encoding": encoding}):
            assert read_body(allow_compression=True) == payload
    with app.test_request_context(method="POST", data=payload, headers={"Content-Encoding": "br"}):
        with pytest.raises(TritonError) as caught:
            read_body(allow_compression=True)
        assert caught.value.status == 501 and caught.value.message == "Unsupported compression type"
    with app.test_request_context(method="POST", data=gzip.compress(payload), headers={"Content-Encoding": "gzip"}):
        with pytest.raises(TritonError, match="Unsupported content-encoding, only 'identity' is supported."):
            read_body(allow_compression=False)
