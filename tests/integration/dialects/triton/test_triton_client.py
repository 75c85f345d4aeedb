"""Triton / KServe v2 over HTTP with the official `tritonclient.http` (sync and aio) against the real
server and its default models: the LLM, the embedding model and Triton's example model `simple`."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
import tritonclient.http.aio as aioclient
from tritonclient.utils import InferenceServerException

LLM = "smollm2-135m-instruct"
EMBEDDING = "all-minilm-l6-v2"
PROMPT = "The capital of France is"

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(default_server):
    triton = httpclient.InferenceServerClient(default_server.base.removeprefix("http://"), concurrency=2)
    yield triton
    triton.close()


def text_input(prompt, binary=True, shape=(1,)):
    tensor = httpclient.InferInput("text_input", list(shape), "BYTES")
    tensor.set_data_from_numpy(np.array([prompt], dtype=object).reshape(shape), binary_data=binary)
    return tensor


def scalar_input(name, datatype, value, binary=True):
    dtype = {"INT32": np.int32, "BOOL": np.bool_, "BYTES": object, "FP32": np.float32}[datatype]
    tensor = httpclient.InferInput(name, [1], datatype)
    tensor.set_data_from_numpy(np.array([value], dtype=dtype), binary_data=binary)
    return tensor


def simple_inputs(input0_binary=False, input1_binary=True):
    first, second = np.arange(16, dtype=np.int32).reshape(1, 16), np.ones((1, 16), dtype=np.int32)
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), httpclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(first, binary_data=input0_binary)
    inputs[1].set_data_from_numpy(second, binary_data=input1_binary)
    return inputs, first, second


def test_health_and_server_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(LLM) and client.is_model_ready("simple", "1")
    assert not client.is_model_ready("nope")
    metadata = client.get_server_metadata()
    assert metadata["name"] == "triton" and isinstance(metadata["version"], str)
    assert "binary_tensor_data" in metadata["extensions"] and "classification" not in metadata["extensions"]


def test_model_metadata_config_and_statistics(client):
    llm = client.get_model_metadata(LLM)
    inputs = {i["name"]: i for i in llm["inputs"]}
    assert inputs["text_input"] == {"name": "text_input", "datatype": "BYTES", "shape": [1]}
    assert {o["name"]: o["datatype"] for o in llm["outputs"]}["text_output"] == "BYTES"
    assert llm["versions"] == ["1"] and client.get_model_metadata(LLM, model_version="1")["name"] == LLM
    embedding = client.get_model_metadata(EMBEDDING)
    assert embedding["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [-1, 384]}]
    config = client.get_model_config("simple")
    assert config["name"] == "simple" and config["max_batch_size"] == 0
    assert config["model_transaction_policy"]["decoupled"] is False
    with pytest.raises(InferenceServerException) as caught:
        client.get_model_metadata("nope")
    assert caught.value.status() == "404" and "Request for unknown model: 'nope' is not found" in caught.value.message()
    with pytest.raises(InferenceServerException) as caught:
        client.get_model_metadata(LLM, model_version="7")
    assert caught.value.status() == "404" and "version 7 is not found" in caught.value.message()
    before = client.get_inference_statistics("simple")["model_stats"][0]["inference_count"]
    client.infer("simple", simple_inputs()[0])
    stats = client.get_inference_statistics("simple")["model_stats"]
    assert len(stats) == 1 and stats[0]["inference_count"] == before + 1
    assert {s["name"] for s in client.get_inference_statistics()["model_stats"]} == {LLM, EMBEDDING, "simple"}


def test_repository_index_and_refused_loading(client):
    index = client.get_model_repository_index()
    assert {(m["name"], m["state"]) for m in index} == {(LLM, "READY"), (EMBEDDING, "READY"), ("simple", "READY")}
    for call in (client.load_model, client.unload_model):
        with pytest.raises(InferenceServerException) as caught:
            call(LLM)
        assert caught.value.status() == "503" and "not allowed" in caught.value.message()


def test_llm_infer_with_json_tensors_both_ways(client):
    outputs = [httpclient.InferRequestedOutput("text_output", binary_data=False)]
    result = client.infer(LLM, [text_input(PROMPT, binary=False), scalar_input("max_tokens", "INT32", 6, False)],
                          outputs=outputs)
    (text,) = result.as_numpy("text_output")
    assert isinstance(text, str) and "Paris" in text and not text.startswith(PROMPT)


def test_llm_infer_with_binary_tensors_both_ways(client):
    result = client.infer(LLM, [text_input(PROMPT), scalar_input("max_tokens", "INT32", 6)],
                          outputs=[httpclient.InferRequestedOutput("text_output")], request_id="42")
    (text,) = result.as_numpy("text_output")
    assert isinstance(text, bytes) and b"Paris" in text
    assert result.get_response()["id"] == "42" and result.get_response()["model_version"] == "1"
    for prompt in ("Qu'est-ce que la tour Eiffel ? é", "a\0b"):  # non-ASCII and a NUL travel byte-exact
        assert client.infer(LLM, [text_input(prompt.encode()), scalar_input("max_tokens", "INT32", 2)])


def test_llm_outputs_none_returns_binary_and_extra_tensors_are_honoured(client):
    inputs = [text_input(PROMPT, shape=(1, 1)), scalar_input("stream", "BOOL", False),
              scalar_input("sampling_parameters", "BYTES", b'{"max_tokens": "4"}'),
              scalar_input("return_finish_reason", "BOOL", True), scalar_input("return_num_output_tokens", "BOOL", True),
              scalar_input("exclude_input_in_output", "BOOL", False)]
    result = client.infer(LLM, inputs, parameters={"temperature": 0.0})
    assert result.get_output("text_output")["shape"] == [1, 1]  # text_output echoes text_input's rank
    assert all("binary_data_size" in o["parameters"] for o in result.get_response()["outputs"])
    text = result.as_numpy("text_output")[0][0].decode()
    assert text.startswith(PROMPT + " Paris")  # exclude_input_in_output=false prepends the prompt
    assert result.as_numpy("finish_reason").tolist() == [b"length"]
    assert result.as_numpy("num_output_tokens").tolist() == [4] and result.as_numpy("num_output_tokens").dtype == np.uint32


def test_embedding_model_answers_fp32_in_binary(client, default_server):
    result = client.infer(EMBEDDING, [text_input(["a cat", "a kitten"], shape=(2,))])
    vectors = result.as_numpy("embedding")
    assert vectors.dtype == np.float32 and vectors.shape == (2, 384)
    assert result.get_output("embedding")["parameters"]["binary_data_size"] == 2 * 384 * 4
    lmi = requests.post(default_server.url(f"/predictions/{EMBEDDING}"), json={"inputs": ["a cat"]}, timeout=60).json()
    assert np.allclose(vectors[0], lmi[0], atol=1e-6)


def test_simple_mixes_json_and_binary_inputs_and_outputs(client):
    inputs, first, second = simple_inputs(input0_binary=False, input1_binary=True)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=False)]
    result = client.infer("simple", inputs, outputs=outputs, model_version="1", request_id="7")
    assert np.array_equal(result.as_numpy("OUTPUT0"), first + second)
    assert np.array_equal(result.as_numpy("OUTPUT1"), first - second)
    assert "data" in result.get_output("OUTPUT1") and "data" not in result.get_output("OUTPUT0")
    assert result.get_response()["id"] == "7"


@pytest.mark.parametrize("request_algorithm", [None, "gzip", "deflate"])
@pytest.mark.parametrize("response_algorithm", [None, "gzip", "deflate"])
def test_compression_both_ways(client, request_algorithm, response_algorithm):
    inputs, first, second = simple_inputs(input0_binary=True, input1_binary=True)
    result = client.infer("simple", inputs, request_compression_algorithm=request_algorithm,
                          response_compression_algorithm=response_algorithm)
    assert np.array_equal(result.as_numpy("OUTPUT0"), first + second)
    assert np.array_equal(result.as_numpy("OUTPUT1"), first - second)


def test_async_infer_and_batched_requests(client):
    pending = [client.async_infer("simple", simple_inputs()[0]) for _ in range(4)]
    for request in pending:
        assert request.get_result().as_numpy("OUTPUT0")[0].tolist() == list(range(1, 17))


def test_aio_client(default_server):
    async def run():
        aio = aioclient.InferenceServerClient(default_server.base.removeprefix("http://"))
        try:
            assert await aio.is_server_live() and await aio.is_server_ready()
            assert (await aio.get_server_metadata())["name"] == "triton"
            assert await aio.is_model_ready(LLM)
            inputs = [aioclient.InferInput("text_input", [1], "BYTES"), aioclient.InferInput("max_tokens", [1], "INT32")]
            inputs[0].set_data_from_numpy(np.array([PROMPT], dtype=object), binary_data=False)
            inputs[1].set_data_from_numpy(np.array([6], dtype=np.int32))
            result = await aio.infer(LLM, inputs, outputs=[aioclient.InferRequestedOutput("text_output", False)])
            return result.as_numpy("text_output")[0]
        finally:
            await aio.close()

    assert "Paris" in asyncio.run(run())


@pytest.mark.parametrize("build, status, message", [
    (lambda: [text_input(PROMPT), scalar_input("max_tokenz", "INT32", 3)], "400",
     f"unexpected inference input 'max_tokenz' for model '{LLM}'"),
    (lambda: [text_input(PROMPT), scalar_input("max_tokens", "FP32", 3.0)], "400",
     f"inference input 'max_tokens' data-type is 'FP32', but model '{LLM}' expects 'INT32'"),
    (lambda: [text_input([PROMPT, PROMPT], shape=(2,))], "400",
     f"unexpected shape for input 'text_input' for model '{LLM}'. Expected [1], got [2]"),
    (lambda: [scalar_input("max_tokens", "INT32", 3)], "400",
     f"expected number of inputs between 1 and 12 but got 1 inputs for model '{LLM}'"),
])
def test_contract_errors_reach_the_client(client, build, status, message):
    with pytest.raises(InferenceServerException) as caught:
        client.infer(LLM, build())
    assert caught.value.status() == status and message in caught.value.message()
    simple_missing = simple_inputs()[0][:1]
    with pytest.raises(InferenceServerException, match="missing required input\\(s\\) \\['INPUT1'\\]"):
        client.infer("simple", simple_missing)
