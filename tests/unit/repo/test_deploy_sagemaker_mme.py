"""deploy/sagemaker's multi-model endpoint against botocore's Stubber (no network), as
test_deploy_sagemaker.py does for the single-model one: CreateModel's container in MultiModel mode, and
InvokeEndpoint's TargetModel from the invoke examples."""

from __future__ import annotations

import json

import boto3
import pytest
from botocore.stub import Stubber

from test_deploy_sagemaker import (
    IMAGE, REGION, ROLE, _args, _load, _runtime, _sdk_client, _streaming_body, _stub_deployment, deploy_script,
)

invoke_script = _load("invoke")


@pytest.fixture
def session() -> boto3.Session:
    return boto3.Session(aws_access_key_id="AKIDEXAMPLE", aws_secret_access_key="secret", region_name=REGION)


def test_a_multi_model_endpoint_is_a_multimodel_container_over_the_archives_prefix(session):
    recipe, _ = deploy_script.parse_args(_args(
        "--multi-model", "--model-data", "s3://bucket/fine-tunes", "--dtype", "fp32",
        "--env", "OPTION_MME_MEMORY_LIMIT=12GiB"))
    # No OPTION_MODEL_NAME: the container starts empty and each model is named by SageMaker's load call;
    # the options apply to every model it loads.
    env = {"SAGEMAKER_MULTI_MODEL": "true", "OPTION_DTYPE": "fp32", "OPTION_MME_MEMORY_LIMIT": "12GiB"}
    assert recipe.environment() == env
    container = {"Image": IMAGE, "Environment": env, "Mode": "MultiModel",
                 "ModelDataUrl": "s3://bucket/fine-tunes/"}
    # no ModelDataDownloadTimeoutInSeconds: nothing is copied before the container starts
    variant = {"VariantName": "AllTraffic", "ModelName": "llama3", "InitialInstanceCount": 1,
               "InstanceType": "ml.g5.12xlarge", "ContainerStartupHealthCheckTimeoutInSeconds": 540}
    with Stubber(_sdk_client(session, "sagemaker")) as stub:
        _stub_deployment(stub, ("Creating", "InService"), variant=variant,
                         model={"ModelName": "llama3", "PrimaryContainer": container, "ExecutionRoleArn": ROLE})
        endpoint = deploy_script.deploy(recipe, session, poll=0)
        stub.assert_no_pending_responses()
    assert endpoint.endpoint_status == "InService"


def test_multi_model_recipes_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="needs model_data"):
        deploy_script.parse_args(_args("--multi-model", "--model-id", "/opt/ml/model/x"))
    with pytest.raises(ValueError, match="one model"):
        deploy_script.parse_args(_args("--multi-model", "--model-data", "s3://b/p/",
                                       "--async-output-path", "s3://b/out/"))


@pytest.mark.parametrize("call", ["generate", "chat"])
def test_invoke_names_the_target_model_on_a_multi_model_endpoint(session, call):
    runtime = _runtime(session)
    with Stubber(runtime) as stub:
        if call == "chat":
            reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}}]}
            messages = [{"role": "user", "content": "Hello"}]
            stub.add_response("invoke_endpoint", {"Body": _streaming_body(json.dumps(reply).encode())},
                              {"EndpointName": "tunes", "ContentType": "application/json",
                               "Accept": "application/json", "TargetModel": "bot.tar.gz",
                               "Body": json.dumps({"messages": messages, "max_tokens": 4})})
            assert invoke_script.chat(runtime, "tunes", messages, max_tokens=4, target_model="bot.tar.gz") == "Hi"
        else:
            stub.add_response("invoke_endpoint", {"Body": _streaming_body(b'{"generated_text": "Hi"}')},
                              {"EndpointName": "tunes", "ContentType": "application/json",
                               "Accept": "application/json", "TargetModel": "bot.tar.gz",
                               "Body": json.dumps({"inputs": "Hello", "parameters": {"max_new_tokens": 4}})})
            assert invoke_script.generate(runtime, "tunes", "Hello", max_new_tokens=4,
                                          target_model="bot.tar.gz") == "Hi"
        stub.assert_no_pending_responses()



def test_streaming_or_async_with_a_target_model_is_refused(capsys):
    """The runtime's streaming and asynchronous calls take no TargetModel (botocore's service model):
    the example says so instead of failing in botocore's validation."""
    for mode in (["--stream", "Hello"], ["--async-input", "s3://b/r.json"]):
        with pytest.raises(SystemExit):
            invoke_script.main(["--endpoint", "tunes", "--region", REGION, "--target-model", "bot.tar.gz", *mode])
        assert "InvokeEndpoint only" in capsys.readouterr().err
    shape = boto3.Session(region_name=REGION).client("sagemaker-runtime").meta.service_model
    for operation in ("InvokeEndpointWithResponseStream", "InvokeEndpointAsync"):
        assert "TargetModel" not in shape.operation_model(operation).input_shape.members
    assert "TargetModel" in shape.operation_model("InvokeEndpoint").input_shape.members


def test_the_multi_model_environment_is_what_lmi_serve_resolves():
    """The recipe's container starts with no model, in multi-model mode, with the endpoint's limit."""
    from lmi_serve.config.sources import build_server_config

    recipe, _ = deploy_script.parse_args(_args("--multi-model", "--model-data", "s3://bucket/tunes/",
                                               "--env", "OPTION_MME_MEMORY_LIMIT=12GiB"))
    server = build_server_config({**recipe.environment(), "SAGEMAKER_BIND_TO_PORT": "8080"})
    assert (server.multi_model, server.models, server.mme_memory_limit) == (True, (), 12 * 2**30)
    assert (server.workers, server.model_url_root, server.port) == (1, "/opt/ml/models", deploy_script.CONTAINER_PORT)
