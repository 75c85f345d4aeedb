"""deploy/sagemaker's asynchronous endpoint, Batch Transform job and InvokeEndpointAsync against
botocore's Stubber (no network), as test_deploy_sagemaker.py does for the real-time endpoint; the
transform job's settings read from a real lmi-serve app's /execution-parameters."""

from __future__ import annotations

import threading

import boto3
import pytest
from botocore.stub import Stubber
from sagemaker.core.utils.utils import SageMakerClient
from werkzeug.serving import make_server

from lmi_serve.config.sources import build_server_config
from lmi_serve.server.app import create_app
from lmi_serve.serving.registry import ModelRegistry

from test_deploy_sagemaker import ARN, CREATED, IMAGE, REGION, ROLE, _args, _load, deploy_script

transform_script = _load("transform")
invoke_script = _load("invoke")


@pytest.fixture
def session() -> boto3.Session:
    return boto3.Session(aws_access_key_id="AKIDEXAMPLE", aws_secret_access_key="secret", region_name=REGION)


def _sagemaker(session):
    return SageMakerClient(session=session, region_name=REGION).get_client("sagemaker")


# --- asynchronous endpoint ---------------------------------------------------------------------------

def test_async_endpoint_config_and_payload_limit(session):
    recipe, _ = deploy_script.parse_args(_args(
        "--model-id", "/opt/ml/model/llama3", "--no-wait", "--max-payload-mb", "512",
        "--async-output-path", "s3://bucket/async/out/", "--async-failure-path", "s3://bucket/async/failed/",
        "--async-max-concurrent", "32"))
    env = {"OPTION_MODEL_NAME": "llama3", "HF_MODEL_ID": "/opt/ml/model/llama3", "SAGEMAKER_MAX_PAYLOAD_IN_MB": "512",
           "OPTION_GENERATION_DEADLINE": "off"}
    assert recipe.environment() == env
    served = build_server_config(env)
    assert served.max_request_size == 512 * 2**20  # the body limit lmi-serve enforces
    # an invocation may take an hour: no 55 s deadline, though the instance looks like a real-time endpoint's
    assert served.models[0].generation_deadline is None
    endpoint = build_server_config({**env, "SAGEMAKER_BIND_TO_PORT": "8080"})
    assert endpoint.models[0].generation_deadline is None
    variant = {"VariantName": "AllTraffic", "ModelName": "llama3", "InitialInstanceCount": 1,
               "InstanceType": "ml.g5.12xlarge", "ContainerStartupHealthCheckTimeoutInSeconds": 540}
    with Stubber(_sagemaker(session)) as stub:
        stub.add_response("create_model", {"ModelArn": f"{ARN}:model/llama3"},
                          {"ModelName": "llama3", "ExecutionRoleArn": ROLE,
                           "PrimaryContainer": {"Image": IMAGE, "Environment": env}})
        stub.add_response("describe_model", {"ModelName": "llama3", "ModelArn": f"{ARN}:model/llama3",
                                             "CreationTime": CREATED}, {"ModelName": "llama3"})
        stub.add_response("create_endpoint_config", {"EndpointConfigArn": f"{ARN}:endpoint-config/llama3"}, {
            "EndpointConfigName": "llama3", "ProductionVariants": [variant],
            "AsyncInferenceConfig": {
                "OutputConfig": {"S3OutputPath": "s3://bucket/async/out/",
                                 "S3FailurePath": "s3://bucket/async/failed/"},
                "ClientConfig": {"MaxConcurrentInvocationsPerInstance": 32}}})
        stub.add_response("describe_endpoint_config", {
            "EndpointConfigName": "llama3", "EndpointConfigArn": f"{ARN}:endpoint-config/llama3",
            "ProductionVariants": [variant], "CreationTime": CREATED}, {"EndpointConfigName": "llama3"})
        stub.add_response("create_endpoint", {"EndpointArn": f"{ARN}:endpoint/llama3"},
                          {"EndpointName": "llama3", "EndpointConfigName": "llama3"})
        stub.add_response("describe_endpoint", {
            "EndpointName": "llama3", "EndpointArn": f"{ARN}:endpoint/llama3", "EndpointStatus": "Creating",
            "EndpointConfigName": "llama3", "CreationTime": CREATED, "LastModifiedTime": CREATED},
            {"EndpointName": "llama3"})
        deploy_script.deploy(recipe, session, wait=False)
        stub.assert_no_pending_responses()


def test_a_real_time_endpoint_has_no_async_config():
    recipe, _ = deploy_script.parse_args(_args("--model-id", "m"))
    assert recipe.async_inference_config() is None


def test_bad_async_recipes_are_refused():
    with pytest.raises(ValueError, match="s3://"):
        deploy_script.parse_args(_args("--model-id", "m", "--async-output-path", "/tmp/out"))
    with pytest.raises(ValueError, match="needs async_output_path"):
        deploy_script.parse_args(_args("--model-id", "m", "--async-max-concurrent", "4"))


def test_model_only_for_a_transform_job(session):
    recipe, _ = deploy_script.parse_args(_args("--model-id", "m"))
    with Stubber(_sagemaker(session)) as stub:
        stub.add_response("create_model", {"ModelArn": f"{ARN}:model/llama3"}, {
            "ModelName": "llama3", "ExecutionRoleArn": ROLE,
            "PrimaryContainer": {"Image": IMAGE, "Environment": recipe.environment()}})
        stub.add_response("describe_model", {"ModelName": "llama3", "ModelArn": f"{ARN}:model/llama3",
                                             "CreationTime": CREATED}, {"ModelName": "llama3"})
        assert deploy_script.create_model(recipe, session).model_name == "llama3"
        stub.assert_no_pending_responses()


def test_invoke_async_names_the_s3_request_and_returns_the_output_location(session):
    runtime = session.client("sagemaker-runtime", region_name=REGION)
    with Stubber(runtime) as stub:
        stub.add_response("invoke_endpoint_async",
                          {"InferenceId": "i-1", "OutputLocation": "s3://bucket/async/out/i-1.out"},
                          {"EndpointName": "llama3-async", "InputLocation": "s3://bucket/requests/r1.json",
                           "ContentType": "application/json", "Accept": "application/json",
                           "InvocationTimeoutSeconds": 3600})
        assert invoke_script.invoke_async(runtime, "llama3-async", "s3://bucket/requests/r1.json",
                                          timeout=3600) == "s3://bucket/async/out/i-1.out"
        stub.assert_no_pending_responses()


# --- Batch Transform ------------------------------------------------------------------------------------

TRANSFORM_ARGS = ["--name", "llama3-batch", "--model", "llama3", "--input", "s3://bucket/prompts/",
                  "--output", "s3://bucket/answers/", "--instance-type", "ml.g5.2xlarge"]
DESCRIBED = {"TransformJobName": "llama3-batch", "TransformJobArn": f"{ARN}:transform-job/llama3-batch",
             "ModelName": "llama3", "CreationTime": CREATED,
             "TransformInput": {"DataSource": {"S3DataSource": {"S3DataType": "S3Prefix",
                                                                "S3Uri": "s3://bucket/prompts/"}}},
             "TransformResources": {"InstanceType": "ml.g5.2xlarge", "InstanceCount": 1}}


def _expected_job(**extra) -> dict:
    return {"TransformJobName": "llama3-batch", "ModelName": "llama3", "BatchStrategy": "MultiRecord",
            "TransformInput": {"DataSource": {"S3DataSource": {"S3DataType": "S3Prefix",
                                                               "S3Uri": "s3://bucket/prompts/"}},
                               "ContentType": "application/jsonlines", "SplitType": "Line"},
            "TransformOutput": {"S3OutputPath": "s3://bucket/answers/", "Accept": "application/jsonlines",
                                "AssembleWith": "Line"},
            "TransformResources": {"InstanceType": "ml.g5.2xlarge", "InstanceCount": 1}, **extra}


@pytest.fixture(scope="module")
def container_url():
    """A real lmi-serve app (models configured, not loaded) answering /execution-parameters over HTTP."""
    config = build_server_config({"HF_MODEL_ID": "org/tiny", "OPTION_MAX_ROLLING_BATCH_SIZE": "24",
                                  "SAGEMAKER_MAX_PAYLOAD_IN_MB": "12"})
    server = make_server("127.0.0.1", 0, create_app(config, ModelRegistry.from_config(config)), threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join(5)


def test_transform_job_with_the_containers_execution_parameters(session, container_url):
    recipe, _ = transform_script.parse_args(TRANSFORM_ARGS + ["--execution-parameters-url", container_url,
                                                              "--invocation-timeout", "3600"])
    assert (recipe.max_concurrent, recipe.max_payload_mb) == (24, 12)
    with Stubber(_sagemaker(session)) as stub:
        stub.add_response("create_transform_job", {"TransformJobArn": DESCRIBED["TransformJobArn"]}, _expected_job(
            MaxConcurrentTransforms=24, MaxPayloadInMB=12,
            ModelClientConfig={"InvocationsTimeoutInSeconds": 3600}))
        stub.add_response("describe_transform_job", {**DESCRIBED, "TransformJobStatus": "InProgress"},
                          {"TransformJobName": "llama3-batch"})
        stub.add_response("describe_transform_job", {**DESCRIBED, "TransformJobStatus": "Completed"},
                          {"TransformJobName": "llama3-batch"})
        job = transform_script.transform(recipe, session, poll=0)
        stub.assert_no_pending_responses()
    assert job.transform_job_status == "Completed"


def test_given_values_win_and_unset_ones_are_left_to_sagemaker(session, container_url):
    given, _ = transform_script.parse_args(TRANSFORM_ARGS + ["--max-concurrent", "4", "--execution-parameters-url",
                                                             container_url])
    assert (given.max_concurrent, given.max_payload_mb) == (4, 12)
    recipe, _ = transform_script.parse_args(TRANSFORM_ARGS + ["--content-type", "application/json", "--no-wait"])
    expected = _expected_job()
    expected["TransformInput"]["ContentType"] = "application/json"
    with Stubber(_sagemaker(session)) as stub:  # no MaxConcurrentTransforms: SageMaker asks the container
        stub.add_response("create_transform_job", {"TransformJobArn": DESCRIBED["TransformJobArn"]}, expected)
        stub.add_response("describe_transform_job", {**DESCRIBED, "TransformJobStatus": "InProgress"},
                          {"TransformJobName": "llama3-batch"})
        assert transform_script.transform(recipe, session, wait=False).transform_job_status == "InProgress"
        stub.assert_no_pending_responses()


def test_bad_transform_recipes_are_refused():
    with pytest.raises(ValueError, match="s3://"):
        transform_script.parse_args(["--input", "/local"] + TRANSFORM_ARGS[:4] + TRANSFORM_ARGS[6:])
    with pytest.raises(ValueError, match="1 to 100"):
        transform_script.parse_args(TRANSFORM_ARGS + ["--max-payload-mb", "200"])
    with pytest.raises(ValueError, match="3600"):
        transform_script.parse_args(TRANSFORM_ARGS + ["--invocation-timeout", "7200"])
