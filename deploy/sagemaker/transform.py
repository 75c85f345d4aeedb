"""Run a SageMaker Batch Transform job on an lmi-serve model, with the SageMaker Python SDK v3's resource API.

    python deploy/sagemaker/deploy.py --model-only --image ... --role ... --model-data s3://.../ --name llama3 \\
        --instance-type ml.g5.2xlarge
    python deploy/sagemaker/transform.py --model llama3 --name llama3-batch-1 --instance-type ml.g5.2xlarge \\
        --input s3://bucket/prompts/ --output s3://bucket/answers/

The input is JSON Lines, one LMI request a line (`{"inputs": "...", "parameters": {...}}`, or a chat
request with `messages`). The job splits it by line (SplitType Line) and sends mini-batches of lines
(BatchStrategy MultiRecord) to POST /invocations; lmi-serve answers each line with one line, in order,
a bad line with its error object in its place, and SageMaker joins the answers by line (AssembleWith
Line): line N of the output answers line N of the input.

MaxConcurrentTransforms (requests in flight per instance) and MaxPayloadInMB (the largest mini-batch)
come from `--max-concurrent` / `--max-payload-mb`, else from a running container's GET
/execution-parameters (`--execution-parameters-url`, e.g. the image run locally), else they are left
unset and SageMaker asks the container's /execution-parameters itself: the rolling batch's rows, and
lmi-serve's body limit (SAGEMAKER_MAX_PAYLOAD_IN_MB) capped at SageMaker's 100 MB.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import urllib.request

import boto3
from sagemaker.core.resources import TransformJob
from sagemaker.core.shapes import (
    ModelClientConfig, TransformDataSource, TransformInput, TransformOutput, TransformResources,
    TransformS3DataSource,
)

JSONLINES = "application/jsonlines"
#: SageMaker's ceiling for MaxPayloadInMB and for a mini-batch's invocation timeout (seconds)
MAX_PAYLOAD_MB = 100
MAX_INVOCATION_TIMEOUT = 3600


@dataclasses.dataclass(frozen=True)
class TransformRecipe:
    """One transform job over a JSON Lines input prefix, answered line by line."""

    name: str
    model_name: str
    input_path: str
    output_path: str
    instance_type: str
    instance_count: int = 1
    content_type: str = JSONLINES
    max_concurrent: int | None = None
    max_payload_mb: int | None = None
    # a mini-batch answers all its lines before it returns: long generations need more than the 600 s default
    invocation_timeout: int | None = None

    def __post_init__(self) -> None:
        for path in (self.input_path, self.output_path):
            if not path.startswith("s3://"):
                raise ValueError(f"input and output must be s3:// prefixes, not {path!r}")
        if self.max_payload_mb is not None and not 1 <= self.max_payload_mb <= MAX_PAYLOAD_MB:
            raise ValueError(f"max_payload_mb must be 1 to {MAX_PAYLOAD_MB} (SageMaker's limit)")
        if self.invocation_timeout is not None and not 1 <= self.invocation_timeout <= MAX_INVOCATION_TIMEOUT:
            raise ValueError(f"invocation_timeout must be 1 to {MAX_INVOCATION_TIMEOUT} seconds")

    def with_container_parameters(self, parameters: dict) -> TransformRecipe:
        """This recipe with what a container's /execution-parameters says, where it gave nothing itself."""
        return dataclasses.replace(
            self, max_concurrent=self.max_concurrent or int(parameters["MaxConcurrentTransforms"]),
            max_payload_mb=self.max_payload_mb or min(MAX_PAYLOAD_MB, int(parameters["MaxPayloadInMB"])))

    def create_arguments(self) -> dict:
        """TransformJob.create's arguments (CreateTransformJob's parameters)."""
        arguments = {
            "transform_job_name": self.name, "model_name": self.model_name, "batch_strategy": "MultiRecord",
            "transform_input": TransformInput(
                data_source=TransformDataSource(s3_data_source=TransformS3DataSource(
                    s3_data_type="S3Prefix", s3_uri=self.input_path)),
                content_type=self.content_type, split_type="Line"),
            "transform_output": TransformOutput(s3_output_path=self.output_path, accept=JSONLINES,
                                                assemble_with="Line"),
            "transform_resources": TransformResources(instance_type=self.instance_type,
                                                      instance_count=self.instance_count),
        }
        if self.max_concurrent is not None:
            arguments["max_concurrent_transforms"] = self.max_concurrent
        if self.max_payload_mb is not None:
            arguments["max_payload_in_mb"] = self.max_payload_mb
        if self.invocation_timeout is not None:
            arguments["model_client_config"] = ModelClientConfig(
                invocations_timeout_in_seconds=self.invocation_timeout)
        return arguments


def execution_parameters(base_url: str, timeout: float = 10) -> dict:
    """A running lmi-serve container's GET /execution-parameters."""
    with urllib.request.urlopen(base_url.rstrip("/") + "/execution-parameters", timeout=timeout) as answer:
        return json.loads(answer.read())


def transform(recipe: TransformRecipe, session: boto3.Session, *, wait: bool = True, poll: int = 60) -> TransformJob:
    """CreateTransformJob; with `wait`, return once it has Completed (a failed job raises the SDK's error)."""
    job = TransformJob.create(**recipe.create_arguments(), session=session, region=session.region_name)
    if wait:
        job.wait(poll=poll)
    return job


def parse_args(argv: list[str]) -> tuple[TransformRecipe, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", required=True, help="the transform job's name")
    parser.add_argument("--model", required=True, help="a SageMaker model (deploy.py --model-only)")
    parser.add_argument("--input", required=True, help="s3:// prefix of JSON Lines files")
    parser.add_argument("--output", required=True, help="s3:// prefix for the answers (<file>.out)")
    parser.add_argument("--instance-type", required=True)
    parser.add_argument("--instance-count", type=int, default=1)
    parser.add_argument("--content-type", default=JSONLINES, help="the input's ContentType (or application/json)")
    parser.add_argument("--max-concurrent", type=int, help="MaxConcurrentTransforms")
    parser.add_argument("--max-payload-mb", type=int, help="MaxPayloadInMB (a mini-batch's size)")
    parser.add_argument("--execution-parameters-url", help="a running container (http://host:8080) to ask for "
                                                           "the two values above")
    parser.add_argument("--invocation-timeout", type=int, help="seconds one mini-batch may take (max 3600)")
    parser.add_argument("--region", help="AWS region (default: the boto3 session's)")
    parser.add_argument("--no-wait", action="store_true", help="return once CreateTransformJob is accepted")
    args = parser.parse_args(argv)
    recipe = TransformRecipe(
        name=args.name, model_name=args.model, input_path=args.input, output_path=args.output,
        instance_type=args.instance_type, instance_count=args.instance_count, content_type=args.content_type,
        max_concurrent=args.max_concurrent, max_payload_mb=args.max_payload_mb,
        invocation_timeout=args.invocation_timeout)
    if args.execution_parameters_url:
        recipe = recipe.with_container_parameters(execution_parameters(args.execution_parameters_url))
    return recipe, args


def main(argv: list[str] | None = None) -> int:
    recipe, args = parse_args(sys.argv[1:] if argv is None else argv)
    job = transform(recipe, boto3.Session(region_name=args.region), wait=not args.no_wait)
    print(f"transform job {job.transform_job_name}: {job.transform_job_status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
