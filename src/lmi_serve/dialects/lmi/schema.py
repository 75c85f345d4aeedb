"""LMI request schemas -> neutral generation parameters.

`do_sample` when omitted: sampling is on iff the request sets temperature > 0, top_k > 0 or
top_p < 1 (LMI >= 0.32 behaviour). temperature == 0 always means greedy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ...engine.types import SamplingParams


class LmiRequestError(ValueError):
    """The payload does not fit the schema; the message says which field and why."""


class DynamicBatchParameters(BaseModel):
    """GenerationParameters honoured by the dynamic-batch path (rolling_batch=disable)."""

    model_config = ConfigDict(extra="forbid")

    do_sample: bool | None = None
    seed: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0)
    repetition_penalty: float = Field(1.0, gt=0)
    top_k: int = Field(0, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    max_new_tokens: int = Field(30, ge=1)
    return_full_text: bool = False
    stop_sequences: list[str] | None = None

    def sampling(self) -> SamplingParams:
        do_sample = self.do_sample
        if do_sample is None:
            do_sample = ((self.temperature or 0) > 0 or self.top_k > 0
                         or (self.top_p is not None and self.top_p < 1))
        if self.temperature == 0:
            do_sample = False
        return SamplingParams(
            do_sample=do_sample,
            temperature=self.temperature if self.temperature is not None else 1.0,
            top_k=self.top_k,
            top_p=self.top_p if self.top_p is not None else 1.0,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
        )


@dataclass(frozen=True)
class DynamicBatchRequest:
    prompts: list[str]
    parameters: DynamicBatchParameters


def _describe(error: ValidationError, prefix: str) -> str:
    parts = []
    for item in error.errors():
        where = ".".join(str(p) for p in (prefix, *item["loc"]) if p != "")
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


def parse_dynamic_batch_request(payload: Any) -> DynamicBatchRequest:
    """Validate `{"inputs": str | [str], "parameters": {...}}`; unknown fields are rejected."""
    if isinstance(payload, str):
        payload = {"inputs": payload}
    if not isinstance(payload, dict):
        raise LmiRequestError("The request body must be a JSON object with an 'inputs' field")
    unknown = sorted(set(payload) - {"inputs", "parameters"})
    if unknown:
        raise LmiRequestError(f"Unsupported field(s) {unknown}: the dynamic-batch schema has 'inputs' and 'parameters'")
    if "inputs" not in payload:
        raise LmiRequestError("Missing required field 'inputs'")
    inputs = payload["inputs"]
    prompts = [inputs] if isinstance(inputs, str) else inputs
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise LmiRequestError("'inputs' must be a non-empty string or a non-empty list of non-empty strings")
    raw = payload.get("parameters")
    raw = {} if raw is None else raw  # `or {}` would let [], "", 0 and false through as "no parameters"
    if not isinstance(raw, dict):
        raise LmiRequestError("'parameters' must be a JSON object")
    raw = dict(raw)
    if isinstance(raw.get("stop_sequences"), str):
        raw["stop_sequences"] = [raw["stop_sequences"]]
    supported = set(DynamicBatchParameters.model_fields)
    unsupported = sorted(set(raw) - supported)
    if unsupported:
        raise LmiRequestError(
            f"Unsupported parameter(s) {unsupported} with dynamic batching (rolling_batch=disable); "
            f"supported: {sorted(supported)}")
    try:
        params = DynamicBatchParameters.model_validate(raw, strict=False)
    except ValidationError as exc:
        raise LmiRequestError(_describe(exc, "parameters")) from None
    return DynamicBatchRequest(prompts, params)
