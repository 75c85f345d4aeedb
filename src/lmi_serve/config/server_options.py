"""Options for how the server treats one model's requests: timeouts, the waiting queue, token limits
and the replica bounds LMI validates. One concern of `ModelConfig` (config/models.py assembles them);
the process-wide settings are `ServerConfig`'s."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from lmi_serve.config.fields import Options


class ServerOptions(Options):
    """Per-model timeouts and limits."""

    predict_timeout: float = Field(
        120.0, gt=0,
        description=(
            "seconds a request may wait + run (dynamic batch); may wait for a free row (rolling batch: once "
            "generating, it runs to the end)"
        ),
    )
    generation_deadline: float | None = Field(
        None, gt=0,
        description=(
            "seconds a request may generate (rolling batch) before it ends with what it has: finish reason "
            "`length`, header `X-LMI-Deadline-Exceeded` ([SageMaker's 60-second limit]"
            "(operations.md#sagemakers-60-second-limit)); `off`: never"
        ),
        json_schema_extra={"doc_default": "`55` on a SageMaker real-time endpoint, else `off`"},
    )
    model_loading_timeout: float = Field(240.0, gt=0, description="seconds before a loading model counts as failed")
    job_queue_size: int = Field(1000, ge=1, description="waiting requests per model before 503 (TGI routes: 429)")
    max_input_len: int | None = Field(
        None, ge=1,
        description="prompt tokens allowed",
        json_schema_extra={"doc_default": "context − 1"},
    )
    max_model_len: int | None = Field(
        None, ge=1,
        description="prompt + output tokens",
        json_schema_extra={"doc_default": "the model's context"},
    )
    responses_store_size: int = Field(
        64, ge=0, le=100_000,
        description=(
            "/v1/responses: the last responses kept per model and worker for `previous_response_id` and `GET`; "
            "in memory, so a restart forgets them and each worker keeps its own (0: none kept)"
        ),
    )
    min_workers: int = Field(1, ge=0, description="validated; replicas are server-wide (below)")
    max_workers: int = Field(1, ge=1, description="validated; replicas are server-wide (below)")

    @field_validator("generation_deadline", mode="before")
    @classmethod
    def _deadline_off(cls, value: Any) -> Any:
        """`off` (or `none`, `false`, `0`) switches the deadline off, also where SageMaker would set one."""
        if isinstance(value, str) and value.strip().lower() in ("off", "none", "false", "0", "0.0"):
            return None
        return None if value == 0 else value
