"""Call an lmi-serve SageMaker endpoint through the SageMaker runtime (boto3's `sagemaker-runtime` client).

    python deploy/sagemaker/invoke.py --endpoint llama3 "The capital of France is"
    python deploy/sagemaker/invoke.py --endpoint llama3 --stream "Once upon a time"
    python deploy/sagemaker/invoke.py --endpoint llama3 --chat "What is the capital of France?"
    python deploy/sagemaker/invoke.py --endpoint llama3 --adapter sql "List the tables"
    python deploy/sagemaker/invoke.py --endpoint llama3-async --async-input s3://bucket/requests/r1.json
    python deploy/sagemaker/invoke.py --endpoint fine-tunes --target-model support-bot.tar.gz "Hello"

SageMaker forwards every InvokeEndpoint body to the container's POST /invocations, unchanged, with the
ContentType and Accept given here; lmi-serve answers in LMI's schema (docs/lmi.md, "Routes"): `{"inputs",
"parameters"}` -> `{"generated_text"}`; with `"stream": true` one JSON object per line (jsonlines,
`{"token": {"text", ...}}`), which InvokeEndpointWithResponseStream delivers as PayloadPart events whose
boundaries need not fall between lines; a body with `messages` is a chat completion in OpenAI's shape.
An asynchronous endpoint (deploy.py --async-output-path) takes InvokeEndpointAsync instead: the body is
an S3 object (the same JSON), the call returns at once with where the whole answer will be written.
A multi-model endpoint (deploy.py --multi-model) takes `TargetModel`, the archive's path under the
endpoint's prefix: SageMaker loads it on first use and sends the body to POST /models/<id>/invoke.
InvokeEndpointWithResponseStream and InvokeEndpointAsync take no TargetModel: such an endpoint answers
whole responses only.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import boto3


def _parameters(max_new_tokens: int, adapter: str | None) -> dict[str, Any]:
    parameters: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    if adapter:
        parameters["adapters"] = adapter  # a LoRA adapter registered on the endpoint (docs/models.md, "LoRA adapters")
    return parameters


def _target(target_model: str | None) -> dict[str, str]:
    """InvokeEndpoint's TargetModel on a multi-model endpoint (the archive, relative to its prefix)."""
    return {"TargetModel": target_model} if target_model else {}


def generate(runtime, endpoint: str, prompt: str, *, max_new_tokens: int = 64, adapter: str | None = None,
             target_model: str | None = None) -> str:
    """One InvokeEndpoint call; the generated text."""
    body = {"inputs": prompt, "parameters": _parameters(max_new_tokens, adapter)}
    response = runtime.invoke_endpoint(EndpointName=endpoint, ContentType="application/json",
                                       Accept="application/json", Body=json.dumps(body), **_target(target_model))
    return json.loads(response["Body"].read())["generated_text"]


def chat(runtime, endpoint: str, messages: list[dict[str, str]], *, max_tokens: int = 64,
         target_model: str | None = None) -> str:
    """A chat completion through /invocations (OpenAI's request and response shapes); the reply's text."""
    body = {"messages": messages, "max_tokens": max_tokens}
    response = runtime.invoke_endpoint(EndpointName=endpoint, ContentType="application/json",
                                       Accept="application/json", Body=json.dumps(body), **_target(target_model))
    return json.loads(response["Body"].read())["choices"][0]["message"]["content"]


def invoke_async(runtime, endpoint: str, input_location: str, *, content_type: str = "application/json",
                 timeout: int | None = None) -> str:
    """InvokeEndpointAsync: queue the request stored at `input_location` (s3://); the s3:// location
    its answer will be written to. `timeout`: InvocationTimeoutSeconds (SageMaker allows up to 3600)."""
    arguments = {"EndpointName": endpoint, "InputLocation": input_location, "ContentType": content_type,
                 "Accept": "application/json"}
    if timeout is not None:
        arguments["InvocationTimeoutSeconds"] = timeout
    return runtime.invoke_endpoint_async(**arguments)["OutputLocation"]


def stream(runtime, endpoint: str, prompt: str, *, max_new_tokens: int = 64,
           adapter: str | None = None) -> Iterator[str]:
    """InvokeEndpointWithResponseStream: yield each token's text as its line arrives. A failed generation
    (lmi-serve's last line carries `error`) raises RuntimeError; the runtime's error events, botocore's
    EventStreamError."""
    body = {"inputs": prompt, "parameters": _parameters(max_new_tokens, adapter), "stream": True}
    response = runtime.invoke_endpoint_with_response_stream(
        EndpointName=endpoint, ContentType="application/json", Accept="application/jsonlines", Body=json.dumps(body))
    for line in jsonlines(response["Body"]):
        if "error" in line:  # a generation that failed mid-stream ends with a line carrying `error`
            raise RuntimeError(f"the endpoint ended the stream with an error: {line['error']}")
        yield line["token"]["text"]


def jsonlines(events: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Reassemble JSON lines from the event stream's PayloadPart byte chunks (a line may span chunks).
    The runtime's own error events (ModelStreamError, InternalStreamFailure) surface from the
    iteration as botocore's EventStreamError."""
    buffer = b""
    for event in events:
        buffer += event.get("PayloadPart", {}).get("Bytes", b"")
        *lines, buffer = buffer.split(b"\n")
        yield from (json.loads(line) for line in lines if line.strip())
    if buffer.strip():
        yield json.loads(buffer)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--region")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--adapter", help="a LoRA adapter's name")
    parser.add_argument("--target-model", help="on a multi-model endpoint: the model's archive, e.g. bot.tar.gz")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--stream", action="store_true")
    mode.add_argument("--chat", action="store_true", help="send the prompt as a user message")
    mode.add_argument("--async-input", help="s3:// location of a request body, for an asynchronous endpoint")
    parser.add_argument("prompt", nargs="?")
    args = parser.parse_args(argv)
    if args.target_model and (args.stream or args.async_input):  # neither call takes TargetModel
        parser.error("--target-model works with InvokeEndpoint only: multi-model endpoints do not stream "
                     "or run asynchronously")
    if args.prompt is None and not args.async_input:
        parser.error("a prompt is required (or --async-input)")
    runtime = boto3.Session(region_name=args.region).client("sagemaker-runtime")
    if args.async_input:
        print(f"the answer will be written to {invoke_async(runtime, args.endpoint, args.async_input)}")
    elif args.stream:
        for text in stream(runtime, args.endpoint, args.prompt, max_new_tokens=args.max_new_tokens,
                           adapter=args.adapter):
            print(text, end="", flush=True)
        print()
    elif args.chat:
        print(chat(runtime, args.endpoint, [{"role": "user", "content": args.prompt}],
                   max_tokens=args.max_new_tokens, target_model=args.target_model))
    else:
        print(generate(runtime, args.endpoint, args.prompt, max_new_tokens=args.max_new_tokens,
                       adapter=args.adapter, target_model=args.target_model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
