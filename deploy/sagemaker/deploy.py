"""Deploy lmi-serve to a SageMaker real-time or asynchronous endpoint with the SageMaker Python SDK v3's
resource API (Batch Transform, which needs only the model: `--model-only`, then transform.py).

    python deploy/sagemaker/deploy.py --image ACCOUNT.dkr.ecr.REGION.amazonaws.com/lmi-serve:gpu \\
        --role arn:aws:iam::ACCOUNT:role/SageMakerRole --model-data s3://bucket/models/llama-3-8b/ \\
        --instance-type ml.g5.12xlarge --tensor-parallel-degree 4 --dtype bf16 --name llama3

Three calls, each a `sagemaker.core.resources` class (SDK v3 generates them from the service model, one
method per API): `Model.create` (CreateModel: image, role and the environment lmi-serve reads),
`EndpointConfig.create` (CreateEndpointConfig: instance type and count, and the health-check
timeout that must cover the model's load), `Endpoint.create` (CreateEndpoint), then `wait_for_status`
polls DescribeEndpoint until InService. SDK v3's `ModelBuilder` (sagemaker-serve) is not used: it
detects a model server and packs artefacts, which a ready-made container does not need, and the
`sagemaker` 3.x meta-package weighs ~1 GB; v2's `Model(image_uri, env, role).deploy()` is the
previous major version.

`--multi-model` makes a multi-model endpoint (MME): `--model-data` is then an S3 prefix of `.tar.gz`
archives, one model folder each (`tar -czf name.tar.gz -C folder .`). The container definition gets
`Mode: MultiModel` and `ModelDataUrl` = that prefix, and the environment SAGEMAKER_MULTI_MODEL=true; the
container starts with no model, SageMaker copies and unpacks an archive to /opt/ml/models/<id>/model the
first time InvokeEndpoint names it as `TargetModel` (invoke.py --target-model) and calls POST /models,
and unloads the least used ones when a load answers 507 (docs/lmi.md, "Multi-model endpoints"). Every
OPTION_* the recipe sets applies to each model loaded.

`--async-output-path` makes the endpoint asynchronous (the endpoint configuration's
AsyncInferenceConfig): InvokeEndpointAsync names a request body in S3, SageMaker POSTs it to the same
/invocations and writes the whole answer to the output path. Payloads may reach 1 GB and an invocation
an hour, but the container still reads the body: `--max-payload-mb` sets SAGEMAKER_MAX_PAYLOAD_IN_MB,
lmi-serve's body limit (64 MiB by default). MaxConcurrentInvocationsPerInstance bounds the requests
SageMaker sends each instance at once; the rolling batch's rows are the natural value. The container
cannot tell an asynchronous endpoint from a real-time one, so the recipe sets OPTION_GENERATION_DEADLINE=off
(a real-time endpoint's requests end at 55 s: docs/operations.md, "SageMaker's 60-second limit").

The weights come from S3 (`--model-data`, an uncompressed prefix SageMaker copies to /opt/ml/model,
the folder lmi-serve serves, `serving.properties` and `adapters/` included) or are already in the
image (`--model-id`, passed as HF_MODEL_ID: a folder in the image or a hub id in its HF cache; the
server never downloads).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import boto3
from sagemaker.core.resources import Endpoint, EndpointConfig, Model
from sagemaker.core.shapes import (
    AsyncInferenceClientConfig, AsyncInferenceConfig, AsyncInferenceOutputConfig, ContainerDefinition,
    ModelDataSource, ProductionVariant, S3ModelDataSource,
)

# SageMaker's contract with a container (not configurable): GET /ping and POST /invocations on port
# 8080, and SAGEMAKER_BIND_TO_PORT when it picks another; lmi-serve binds what that variable says.
CONTAINER_PORT = 8080
#: lmi-serve's default for OPTION_MODEL_LOADING_TIMEOUT (config/sources.py), seconds
DEFAULT_MODEL_LOADING_TIMEOUT = 240
#: the margin SageMaker's health check gets over the server's own loading timeout: the image's boot
#: (torch import, /ping answers 503 "Loading" within a second of the bind) and the copy from S3.
HEALTH_CHECK_MARGIN = 300
#: the most SageMaker accepts for ContainerStartupHealthCheckTimeoutInSeconds (and the download timeout)
MAX_HEALTH_CHECK_TIMEOUT = 3600


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One endpoint: what lmi-serve serves (turned into its environment) and where SageMaker runs it."""

    image: str
    role: str
    name: str
    instance_type: str
    model_data: str | None = None
    model_id: str | None = None
    dtype: str | None = None
    tensor_parallel_degree: str | None = None
    enable_lora: bool = False
    max_loras: int | None = None
    max_rolling_batch_size: int | None = None
    model_loading_timeout: int | None = None
    graceful_timeout: int | None = None
    instance_count: int = 1
    extra_env: tuple[tuple[str, str], ...] = ()
    max_payload_mb: int | None = None
    async_output_path: str | None = None
    async_failure_path: str | None = None
    async_max_concurrent: int | None = None
    multi_model: bool = False

    def __post_init__(self) -> None:
        if (self.model_data is None) == (self.model_id is None):
            raise ValueError("give exactly one of model_data (an S3 prefix) and model_id (in the image)")
        if self.model_data is not None and not self.model_data.startswith("s3://"):
            raise ValueError(f"model_data must be an s3:// prefix, not {self.model_data!r}")
        if self.multi_model and self.model_data is None:
            raise ValueError("a multi-model endpoint needs model_data: the s3:// prefix of the models' .tar.gz archives")
        if self.multi_model and self.async_output_path is not None:
            raise ValueError("SageMaker's asynchronous endpoints serve one model: drop multi_model or async_output_path")
        for path in (self.async_output_path, self.async_failure_path):
            if path is not None and not path.startswith("s3://"):
                raise ValueError(f"an async inference path must be an s3:// prefix, not {path!r}")
        if self.async_output_path is None and (self.async_failure_path or self.async_max_concurrent):
            raise ValueError("async inference needs async_output_path (where SageMaker writes the answers)")
        if self.health_check_timeout() > MAX_HEALTH_CHECK_TIMEOUT:
            raise ValueError(f"model_loading_timeout {self.model_loading_timeout} s leaves SageMaker's health check "
                             f"no margin: at most {MAX_HEALTH_CHECK_TIMEOUT - HEALTH_CHECK_MARGIN} s")

    def environment(self) -> dict[str, str]:
        """The container's environment: only names lmi-serve's config/sources.py reads, only what was set."""
        # A multi-model endpoint starts with no model: each is named by its load call, not here
        env = {"SAGEMAKER_MULTI_MODEL": "true"} if self.multi_model else {"OPTION_MODEL_NAME": self.name}
        optional = {
            "HF_MODEL_ID": self.model_id,
            "OPTION_DTYPE": self.dtype,
            "TENSOR_PARALLEL_DEGREE": self.tensor_parallel_degree,
            "OPTION_MAX_ROLLING_BATCH_SIZE": self.max_rolling_batch_size,
            "OPTION_MAX_LORAS": self.max_loras,
            "OPTION_MODEL_LOADING_TIMEOUT": self.model_loading_timeout,
            "SERVING_GRACEFUL_TIMEOUT": self.graceful_timeout,
            "SAGEMAKER_MAX_PAYLOAD_IN_MB": self.max_payload_mb,
        }
        env.update({key: str(value) for key, value in optional.items() if value is not None})
        if self.enable_lora:
            env["OPTION_ENABLE_LORA"] = "true"
        if self.async_output_path is not None:  # an hour per invocation, not 60 s: no 55 s generation deadline
            env["OPTION_GENERATION_DEADLINE"] = "off"
        env.update(dict(self.extra_env))
        return env

    def health_check_timeout(self) -> int:
        """Seconds SageMaker waits for /ping to answer 200: the server's loading timeout plus a margin,
        so the server (which reports a stuck load as failed) gives up first."""
        return (self.model_loading_timeout or DEFAULT_MODEL_LOADING_TIMEOUT) + HEALTH_CHECK_MARGIN

    def container(self) -> ContainerDefinition:
        if self.multi_model:  # SageMaker copies each archive under the prefix when a request first names it
            prefix = self.model_data if self.model_data.endswith("/") else self.model_data + "/"
            return ContainerDefinition(image=self.image, environment=self.environment(), mode="MultiModel",
                                       model_data_url=prefix)
        source = None
        if self.model_data is not None:
            prefix = self.model_data if self.model_data.endswith("/") else self.model_data + "/"
            source = ModelDataSource(s3_data_source=S3ModelDataSource(
                s3_uri=prefix, s3_data_type="S3Prefix", compression_type="None"))
        fields = {"image": self.image, "environment": self.environment()}
        if source is not None:
            fields["model_data_source"] = source
        return ContainerDefinition(**fields)

    def production_variant(self) -> ProductionVariant:
        fields = {"variant_name": "AllTraffic", "model_name": self.name, "instance_type": self.instance_type,
                  "initial_instance_count": self.instance_count,
                  "container_startup_health_check_timeout_in_seconds": self.health_check_timeout()}
        if self.model_data is not None and not self.multi_model:  # large weights take a while to copy from S3
            fields["model_data_download_timeout_in_seconds"] = self.health_check_timeout()
        return ProductionVariant(**fields)


    def async_inference_config(self) -> AsyncInferenceConfig | None:
        """The endpoint configuration's AsyncInferenceConfig, or None for a real-time endpoint."""
        if self.async_output_path is None:
            return None
        output = {"s3_output_path": self.async_output_path}
        if self.async_failure_path is not None:
            output["s3_failure_path"] = self.async_failure_path
        fields = {"output_config": AsyncInferenceOutputConfig(**output)}
        if self.async_max_concurrent is not None:
            fields["client_config"] = AsyncInferenceClientConfig(
                max_concurrent_invocations_per_instance=self.async_max_concurrent)
        return AsyncInferenceConfig(**fields)


def create_model(recipe: Recipe, session: boto3.Session) -> Model:
    """CreateModel alone: what a Batch Transform job (transform.py) runs."""
    return Model.create(model_name=recipe.name, primary_container=recipe.container(),
                        execution_role_arn=recipe.role, session=session, region=session.region_name)


def deploy(recipe: Recipe, session: boto3.Session, *, wait: bool = True, poll: int = 30) -> Endpoint:
    """Create the model, the endpoint configuration (asynchronous with an output path) and the endpoint,
    all named `recipe.name`; with `wait`, return once the endpoint is InService (a failed one raises
    the SDK's error)."""
    region = session.region_name
    create_model(recipe, session)
    config = {"async_inference_config": recipe.async_inference_config()} if recipe.async_output_path else {}
    EndpointConfig.create(endpoint_config_name=recipe.name, production_variants=[recipe.production_variant()],
                          session=session, region=region, **config)
    endpoint = Endpoint.create(endpoint_name=recipe.name, endpoint_config_name=recipe.name,
                               session=session, region=region)
    if wait:
        endpoint.wait_for_status("InService", poll=poll)
    return endpoint


def parse_args(argv: list[str]) -> tuple[Recipe, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", required=True, help="the lmi-serve image in ECR")
    parser.add_argument("--role", required=True, help="execution role ARN SageMaker assumes")
    parser.add_argument("--name", required=True, help="model, endpoint config, endpoint and served model name")
    parser.add_argument("--instance-type", required=True, help="e.g. ml.g5.2xlarge (1 GPU), ml.g5.12xlarge (4)")
    parser.add_argument("--instance-count", type=int, default=1, help="replicas behind the endpoint")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-data", help="s3:// prefix holding the model folder (copied to /opt/ml/model), or "
                        "with --multi-model the models' .tar.gz archives")
    source.add_argument("--model-id", help="HF_MODEL_ID: a folder in the image or a hub id in its HF cache")
    parser.add_argument("--dtype", choices=["fp32", "fp16", "bf16", "auto"])
    parser.add_argument("--tensor-parallel-degree", help="GPUs per replica (an integer or 'max')")
    parser.add_argument("--enable-lora", action="store_true", help="serve the adapters under <model>/adapters/")
    parser.add_argument("--max-loras", type=int)
    parser.add_argument("--max-rolling-batch-size", type=int)
    parser.add_argument("--model-loading-timeout", type=int, help="seconds (lmi-serve's default: 240)")
    parser.add_argument("--graceful-timeout", type=int, help="SERVING_GRACEFUL_TIMEOUT, seconds")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="any other variable lmi-serve reads (OPTION_*, ...); repeatable")
    parser.add_argument("--max-payload-mb", type=int, help="SAGEMAKER_MAX_PAYLOAD_IN_MB: the body limit (MiB)")
    parser.add_argument("--async-output-path", help="s3:// prefix for async answers: an asynchronous endpoint")
    parser.add_argument("--async-failure-path", help="s3:// prefix for async failures")
    parser.add_argument("--async-max-concurrent", type=int,
                        help="MaxConcurrentInvocationsPerInstance (e.g. the rolling batch's rows)")
    parser.add_argument("--multi-model", action="store_true",
                        help="a multi-model endpoint: models loaded on demand from --model-data's archives")
    parser.add_argument("--model-only", action="store_true", help="create the model only (for transform.py)")
    parser.add_argument("--region", help="AWS region (default: the boto3 session's)")
    parser.add_argument("--no-wait", action="store_true", help="return once CreateEndpoint is accepted")
    args = parser.parse_args(argv)
    extra = []
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--env wants NAME=VALUE, got {item!r}")
        extra.append((key, value))
    recipe = Recipe(
        image=args.image, role=args.role, name=args.name, instance_type=args.instance_type,
        instance_count=args.instance_count, model_data=args.model_data, model_id=args.model_id, dtype=args.dtype,
        tensor_parallel_degree=args.tensor_parallel_degree, enable_lora=args.enable_lora, max_loras=args.max_loras,
        max_rolling_batch_size=args.max_rolling_batch_size, model_loading_timeout=args.model_loading_timeout,
        graceful_timeout=args.graceful_timeout, extra_env=tuple(extra), max_payload_mb=args.max_payload_mb,
        async_output_path=args.async_output_path, async_failure_path=args.async_failure_path,
        async_max_concurrent=args.async_max_concurrent, multi_model=args.multi_model)
    return recipe, args


def main(argv: list[str] | None = None) -> int:
    recipe, args = parse_args(sys.argv[1:] if argv is None else argv)
    session = boto3.Session(region_name=args.region)
    if args.model_only:
        print(f"model {create_model(recipe, session).model_name}")
        return 0
    endpoint = deploy(recipe, session, wait=not args.no_wait)
    print(f"endpoint {endpoint.endpoint_name}: {endpoint.endpoint_status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
