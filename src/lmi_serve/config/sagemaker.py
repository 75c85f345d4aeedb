"""Which SageMaker service, if any, runs this container, as far as its environment tells.

SageMaker has three ways to run an inference container, with different time limits:

- a real-time endpoint (InvokeEndpoint, InvokeEndpointWithResponseStream, multi-model and multi-container
  endpoints): the container must answer within 60 seconds, so `option.generation_deadline` defaults to
  `REALTIME_DEADLINE` there;
- an asynchronous endpoint (InvokeEndpointAsync): up to an hour per invocation;
- a batch transform job: the job's InvocationsTimeoutInSeconds, up to an hour.

What the platform puts in the container (researched, 2026): a batch transform job sets
`SAGEMAKER_BATCH=true` (AWS's "Custom Inference Code with Batch Transform"). An endpoint instance mounts
`/opt/ml/.sagemaker_infra/endpoint-metadata.json` (DJL serving, AWS's LMI server, tells SageMaker by it);
multi-container endpoints also set `SAGEMAKER_BIND_TO_PORT` and `SAGEMAKER_SAFE_PORT_RANGE`, and a
multi-model endpoint runs with `SAGEMAKER_MULTI_MODEL=true` (a real-time feature only). SageMaker gives an
asynchronous endpoint no signal of its own: it looks like a real-time one, so its deployment sets
`OPTION_GENERATION_DEADLINE=off` (deploy/sagemaker/deploy.py does so for `--async-output-path`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from pathlib import Path

#: Mounted on SageMaker endpoint instances; a module constant so tests can point it elsewhere.
ENDPOINT_METADATA = Path("/opt/ml/.sagemaker_infra/endpoint-metadata.json")
#: Seconds a request may generate on a real-time endpoint: SageMaker's 60 s less a margin for the
#: request's parsing before the engine and its rendering after.
REALTIME_DEADLINE = 55.0
_ENDPOINT_VARIABLES = ("SAGEMAKER_BIND_TO_PORT", "SAGEMAKER_SAFE_PORT_RANGE")


class Hosting(enum.Enum):
    """Where the container runs, as far as its environment tells."""

    ELSEWHERE = "elsewhere"
    ENDPOINT = "endpoint"  # a real-time endpoint, or an asynchronous one (they cannot be told apart)
    BATCH_TRANSFORM = "batch transform"


def _on(value: str | None) -> bool:
    return (value or "").strip().lower() in ("true", "1", "yes", "on")


def hosting(env: Mapping[str, str], metadata: Path | None = None) -> Hosting:
    """Batch transform (SAGEMAKER_BATCH), else an endpoint (its metadata file, a multi-container or
    multi-model endpoint's variables), else elsewhere (a laptop, Kubernetes, KServe, `docker run`)."""
    if _on(env.get("SAGEMAKER_BATCH")):
        return Hosting.BATCH_TRANSFORM
    metadata = ENDPOINT_METADATA if metadata is None else metadata
    if (metadata.is_file() or _on(env.get("SAGEMAKER_MULTI_MODEL"))
            or any((env.get(name) or "").strip() for name in _ENDPOINT_VARIABLES)):
        return Hosting.ENDPOINT
    return Hosting.ELSEWHERE


def default_generation_deadline(env: Mapping[str, str], metadata: Path | None = None) -> tuple[float, str] | None:
    """(seconds, why) for `option.generation_deadline` when the user set none; None: off."""
    where = hosting(env, metadata)
    if where is Hosting.ENDPOINT:
        return REALTIME_DEADLINE, "SageMaker real-time endpoint (its 60 s invocation limit)"
    return None
