"""deploy/sagemaker against botocore's Stubber (no network): the exact SageMaker API calls the SDK makes
for a deployment and the runtime calls of the invoke examples (streams as botocore decodes them, their
lines rendered by lmi-serve's own jsonlines formatter), and the container environment checked against
what lmi-serve's own config/sources.py resolves from it."""

from __future__ import annotations

import binascii
import datetime
import importlib.util
import io
import json
import struct
import sys
from pathlib import Path

import boto3
import pytest
from botocore.awsrequest import AWSResponse
from botocore.exceptions import EventStreamError
from botocore.response import StreamingBody
from botocore.stub import Stubber
from sagemaker.core.utils.utils import SageMakerClient

from lmi_serve.config import sources as config
from lmi_serve.dialects.lmi.formatters import FORMATTERS, RenderContext
from lmi_serve.engine.types import FinishReason, TokenEvent

DEPLOY = Path(__file__).resolve().parents[3] / "deploy" / "sagemaker"
REGION = "us-east-1"
ROLE = "arn:aws:iam::123456789012:role/SageMakerRole"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/lmi-serve:gpu"
ARN = f"arn:aws:sagemaker:{REGION}:123456789012"
CREATED = datetime.datetime(2026, 11, 25, tzinfo=datetime.timezone.utc)


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"deploy_sagemaker_{name}", DEPLOY / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


deploy_script = _load("deploy")
invoke_script = _load("invoke")


@pytest.fixture
def session() -> boto3.Session:
    # Fake credentials: a stubbed client never signs a request that leaves the process.
    return boto3.Session(aws_access_key_id="AKIDEXAMPLE", aws_secret_access_key="secret", region_name=REGION)


def _sdk_client(session: boto3.Session, service: str):
    """The client SDK v3's resources use for this session and region (it caches one per pair)."""
    return SageMakerClient(session=session, region_name=REGION).get_client(service)


def _args(*extra: str) -> list[str]:
    return ["--image", IMAGE, "--role", ROLE, "--name", "llama3", "--instance-type", "ml.g5.12xlarge", *extra]


def _stub_deployment(stub: Stubber, statuses: tuple[str, ...], model: dict | None = None,
                     variant: dict | None = None, reason: str | None = None) -> None:
    """The calls of one deployment, in order: each create, then the SDK's describe of what it created,
    then DescribeEndpoint once per status. `model` / `variant`: the exact CreateModel parameters and
    ProductionVariant expected (None: not checked)."""
    variant_out = variant or {"VariantName": "AllTraffic"}
    stub.add_response("create_model", {"ModelArn": f"{ARN}:model/llama3"}, model)
    stub.add_response("describe_model", {"ModelName": "llama3", "ModelArn": f"{ARN}:model/llama3",
                                         "CreationTime": CREATED}, {"ModelName": "llama3"})
    stub.add_response("create_endpoint_config", {"EndpointConfigArn": f"{ARN}:endpoint-config/llama3"},
                      {"EndpointConfigName": "llama3", "ProductionVariants": [variant]} if variant else None)
    stub.add_response("describe_endpoint_config", {
        "EndpointConfigName": "llama3", "EndpointConfigArn": f"{ARN}:endpoint-config/llama3",
        "ProductionVariants": [variant_out], "CreationTime": CREATED}, {"EndpointConfigName": "llama3"})
    stub.add_response("create_endpoint", {"EndpointArn": f"{ARN}:endpoint/llama3"},
                      {"EndpointName": "llama3", "EndpointConfigName": "llama3"})
    for status in statuses:
        described = {"EndpointName": "llama3", "EndpointArn": f"{ARN}:endpoint/llama3", "EndpointStatus": status,
                     "EndpointConfigName": "llama3", "CreationTime": CREATED, "LastModifiedTime": CREATED}
        if reason:
            described["FailureReason"] = reason
        stub.add_response("describe_endpoint", described, {"EndpointName": "llama3"})


def test_deploy_makes_exactly_the_create_calls_and_waits_for_in_service(session):
    recipe, _ = deploy_script.parse_args(_args(
        "--model-data", "s3://bucket/models/llama3", "--dtype", "bf16", "--tensor-parallel-degree", "4",
        "--enable-lora", "--max-loras", "8", "--model-loading-timeout", "900", "--graceful-timeout", "60"))
    env = {"OPTION_MODEL_NAME": "llama3", "OPTION_DTYPE": "bf16", "TENSOR_PARALLEL_DEGREE": "4",
           "OPTION_MAX_LORAS": "8", "OPTION_MODEL_LOADING_TIMEOUT": "900", "SERVING_GRACEFUL_TIMEOUT": "60",
           "OPTION_ENABLE_LORA": "true"}
    container = {"Image": IMAGE, "Environment": env, "ModelDataSource": {"S3DataSource": {
        "S3Uri": "s3://bucket/models/llama3/", "S3DataType": "S3Prefix", "CompressionType": "None"}}}
    variant = {"VariantName": "AllTraffic", "ModelName": "llama3", "InitialInstanceCount": 1,
               "InstanceType": "ml.g5.12xlarge", "ContainerStartupHealthCheckTimeoutInSeconds": 1200,
               "ModelDataDownloadTimeoutInSeconds": 1200}
    with Stubber(_sdk_client(session, "sagemaker")) as stub:
        # Endpoint.create's own describe, then the wait's polls
        _stub_deployment(stub, ("Creating", "Creating", "InService"), variant=variant,
                         model={"ModelName": "llama3", "PrimaryContainer": container, "ExecutionRoleArn": ROLE})
        endpoint = deploy_script.deploy(recipe, session, poll=0)
        stub.assert_no_pending_responses()
    assert endpoint.endpoint_status == "InService"


def test_deploy_without_waiting_stops_after_create_endpoint(session):
    recipe, _ = deploy_script.parse_args(_args("--model-id", "/opt/ml/model/llama3", "--no-wait"))
    assert recipe.environment() == {"OPTION_MODEL_NAME": "llama3", "HF_MODEL_ID": "/opt/ml/model/llama3"}
    variant = {"VariantName": "AllTraffic", "ModelName": "llama3", "InitialInstanceCount": 1,
               "InstanceType": "ml.g5.12xlarge", "ContainerStartupHealthCheckTimeoutInSeconds": 540}
    with Stubber(_sdk_client(session, "sagemaker")) as stub:
        _stub_deployment(stub, ("Creating",), variant=variant, model={
            "ModelName": "llama3", "ExecutionRoleArn": ROLE,
            "PrimaryContainer": {"Image": IMAGE, "Environment": recipe.environment()}})
        endpoint = deploy_script.deploy(recipe, session, wait=False)
        stub.assert_no_pending_responses()
    assert endpoint.endpoint_status == "Creating"


def test_a_failed_endpoint_raises_instead_of_waiting_forever(session):
    recipe, _ = deploy_script.parse_args(_args("--model-id", "/models/x"))
    with Stubber(_sdk_client(session, "sagemaker")) as stub:
        _stub_deployment(stub, ("Creating", "Failed"),
                         reason="The primary container did not pass the ping health check")
        with pytest.raises(Exception, match="ping health check"):
            deploy_script.deploy(recipe, session, poll=0)
        stub.assert_no_pending_responses()


def test_the_environment_is_what_lmi_serve_resolves(tmp_path, monkeypatch):
    """Every variable the recipe sets lands on the field it means, through lmi-serve's own config code,
    with the weights where SageMaker puts them (/opt/ml/model)."""
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(config, "SAGEMAKER_MODEL_DIR", tmp_path)
    recipe, _ = deploy_script.parse_args(_args(
        "--model-data", "s3://bucket/m/", "--dtype", "bf16", "--tensor-parallel-degree", "max", "--enable-lora",
        "--max-loras", "8", "--max-rolling-batch-size", "64", "--model-loading-timeout", "900",
        "--graceful-timeout", "45", "--env", "OPTION_MAX_MODEL_LEN=8192"))
    # SageMaker's own variable: it picks the port, and lmi-serve binds it on all interfaces.
    server = config.build_server_config({**recipe.environment(), "SAGEMAKER_BIND_TO_PORT": "8080"})
    (model,) = server.models
    assert (model.name, model.model_id, model.dtype, model.tensor_parallel_degree) == ("llama3", str(tmp_path),
                                                                                       "bf16", "max")
    assert (model.enable_lora, model.max_loras, model.max_rolling_batch_size) == (True, 8, 64)
    assert (model.model_loading_timeout, model.max_model_len) == (900, 8192)
    assert model.unknown_options == ()  # no OPTION_* name lmi-serve would only pass through
    assert model.generation_deadline == 55  # a real-time endpoint answers within SageMaker's 60 s
    assert (server.graceful_timeout, server.host, server.port) == (45, "0.0.0.0", deploy_script.CONTAINER_PORT)
    # SageMaker's health check outlasts the server's own loading timeout
    assert recipe.production_variant().container_startup_health_check_timeout_in_seconds > model.model_loading_timeout


def test_a_model_id_in_the_image_is_hf_model_id(monkeypatch, tmp_path):
    monkeypatch.setattr(config, "SAGEMAKER_MODEL_DIR", tmp_path / "absent")
    recipe, _ = deploy_script.parse_args(_args("--model-id", "HuggingFaceTB/SmolLM2-135M-Instruct"))
    (model,) = config.build_server_config(recipe.environment()).models
    assert (model.name, model.model_id) == ("llama3", "HuggingFaceTB/SmolLM2-135M-Instruct")
    default = config.ModelConfig.model_fields["model_loading_timeout"].default
    assert deploy_script.DEFAULT_MODEL_LOADING_TIMEOUT == default  # the script's copy of the server's default
    assert recipe.health_check_timeout() > default


def test_bad_recipes_are_refused():
    with pytest.raises(SystemExit):  # one of --model-data / --model-id is required
        deploy_script.parse_args(_args())
    with pytest.raises(ValueError, match="s3://"):
        deploy_script.Recipe(image=IMAGE, role=ROLE, name="x", instance_type="ml.g5.xlarge", model_data="/local")
    with pytest.raises(SystemExit):
        deploy_script.parse_args(_args("--model-id", "m", "--env", "NOVALUE"))
    with pytest.raises(ValueError, match="at most 3300 s"):  # SageMaker's health check stops at 3600 s
        deploy_script.parse_args(_args("--model-id", "m", "--model-loading-timeout", "3400"))


# --- the runtime: invoke examples ----------------------------------------------------------------------

def _runtime(session):
    return session.client("sagemaker-runtime", region_name=REGION)


def test_generate_sends_lmi_json_to_invocations(session):
    runtime = _runtime(session)
    with Stubber(runtime) as stub:
        body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8, "adapters": "geo"}}
        served = FORMATTERS["json"].render_body(RenderContext("The capital of France is"), [
            TokenEvent(1, " Paris", -0.1, False), TokenEvent(2, ".", -0.2, False, FinishReason.LENGTH)])
        stub.add_response("invoke_endpoint", {"Body": _streaming_body(served.encode()),
                                              "ContentType": "application/json"},
                          {"EndpointName": "llama3", "ContentType": "application/json", "Accept": "application/json",
                           "Body": json.dumps(body)})
        assert invoke_script.generate(runtime, "llama3", "The capital of France is", max_new_tokens=8,
                                      adapter="geo") == " Paris."
        stub.assert_no_pending_responses()


def test_chat_sends_messages_and_reads_the_choice(session):
    runtime = _runtime(session)
    messages = [{"role": "user", "content": "Capital of France?"}]
    reply = {"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant",
                                                                              "content": "Paris."}}]}
    with Stubber(runtime) as stub:
        stub.add_response("invoke_endpoint", {"Body": _streaming_body(json.dumps(reply).encode())},
                          {"EndpointName": "llama3", "ContentType": "application/json", "Accept": "application/json",
                           "Body": json.dumps({"messages": messages, "max_tokens": 16})})
        assert invoke_script.chat(runtime, "llama3", messages, max_tokens=16) == "Paris."
        stub.assert_no_pending_responses()


def _event(headers: dict[str, str], payload: bytes) -> bytes:
    """One message of AWS's binary event-stream encoding (string headers), as the runtime sends it:
    total length, headers length, prelude CRC32, headers, payload, message CRC32."""
    encoded = b"".join(bytes([len(k)]) + k.encode() + b"\x07" + struct.pack(">H", len(v)) + v.encode()
                       for k, v in headers.items())
    prelude = struct.pack(">II", 12 + len(encoded) + len(payload) + 4, len(encoded))
    message = prelude + struct.pack(">I", binascii.crc32(prelude)) + encoded + payload
    return message + struct.pack(">I", binascii.crc32(message))


def _payload_part(data: bytes) -> bytes:
    return _event({":event-type": "PayloadPart", ":content-type": "application/octet-stream",
                   ":message-type": "event"}, data)


class _WireRuntime:
    """Answers InvokeEndpointWithResponseStream at the HTTP layer (botocore's before-send hook) with an
    event stream, so botocore's own decoder and parser run; records each request as sent."""

    def __init__(self, runtime, stream: bytes):
        self.requests = []
        self.stream = stream
        runtime.meta.events.register("before-send.sagemaker-runtime.InvokeEndpointWithResponseStream", self.send)

    def send(self, request, **_):
        self.requests.append(request)
        raw = _RawStream(self.stream)
        return AWSResponse(request.url, 200, {"Content-Type": "application/vnd.amazon.eventstream"}, raw)


class _RawStream(io.BytesIO):
    def stream(self, chunk_size=1024, **_):  # urllib3's interface, which botocore's EventStream reads
        while chunk := self.read(chunk_size):
            yield chunk


def _served_stream(*events: TokenEvent) -> bytes:
    """The bytes lmi-serve's /invocations streams for these engine events (its jsonlines formatter)."""
    return FORMATTERS["jsonlines"].render_body(RenderContext("Capital:"), list(events)).encode()


def test_stream_sends_the_request_and_reassembles_lines_split_across_payload_parts(session):
    runtime = _runtime(session)
    data = _served_stream(TokenEvent(1, " Par", -0.5, False), TokenEvent(2, "is", -0.1, False),
                          TokenEvent(3, ".", -0.2, False, FinishReason.LENGTH))
    parts = [data[:7], data[7:40], data[40:41], data[41:]]  # boundaries inside lines, as the runtime may cut
    wire = _WireRuntime(runtime, b"".join(_payload_part(p) for p in parts))
    assert list(invoke_script.stream(runtime, "llama3", "Capital:", max_new_tokens=3, adapter="geo")) == [
        " Par", "is", "."]
    (request,) = wire.requests
    assert request.method == "POST"
    assert request.url == f"https://runtime.sagemaker.{REGION}.amazonaws.com/endpoints/llama3/invocations-response-stream"
    assert (request.headers["Content-Type"], request.headers["X-Amzn-SageMaker-Accept"]) == (
        b"application/json", b"application/jsonlines")
    assert json.loads(request.body) == {"inputs": "Capital:", "stream": True,
                                        "parameters": {"max_new_tokens": 3, "adapters": "geo"}}


def test_stream_raises_on_a_failed_generation(session):
    runtime = _runtime(session)
    failed = _served_stream(TokenEvent(1, " a", -0.5, False),
                            TokenEvent.failure("The server shut down before this request finished"))
    _WireRuntime(runtime, _payload_part(failed))
    tokens = []
    with pytest.raises(RuntimeError, match="shut down before"):
        tokens.extend(invoke_script.stream(runtime, "llama3", "x"))
    assert tokens == [" a"]


def test_the_runtimes_error_event_ends_the_stream_with_its_message(session):
    runtime = _runtime(session)
    error = _event({":message-type": "exception", ":exception-type": "ModelStreamError",
                    ":content-type": "application/json"},
                   json.dumps({"Message": "container exited", "ErrorCode": "ModelError"}).encode())
    _WireRuntime(runtime, _payload_part(_served_stream(TokenEvent(1, " a", -0.5, False))) + error)
    tokens = []
    with pytest.raises(EventStreamError, match="ModelStreamError.*container exited"):
        tokens.extend(invoke_script.stream(runtime, "llama3", "x"))
    assert tokens == [" a"]


def _streaming_body(data: bytes) -> StreamingBody:
    return StreamingBody(io.BytesIO(data), len(data))
