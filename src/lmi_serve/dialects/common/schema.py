"""LMI request schemas -> neutral generation parameters (TGI's routes and Triton's LLM model take
the same parameters, hence this shared place).

Two schemas, as in the LMI docs:
- dynamic batch (`rolling_batch=disable`): `{"inputs": str | [str], "parameters": {...}}`;
- rolling batch: `{"inputs": str, "parameters": GenerationParameters, "stream": bool}`, one prompt
  per request (see `parse_rolling_request` and `to_generation_requests`).

`do_sample` when omitted (LMI >= 0.32 behaviour): sampling is on iff the request explicitly sets
temperature > 0, top_k > 0 or top_p < 1 (rolling batch also: typical_p < 1 or min_p > 0).
temperature == 0 always means greedy, whatever do_sample says.

Rolling-batch rules beyond single-field ranges (`_check_rules`):
- n > 1 or best_of > 1 needs sampling (unless num_beams > 1), and best_of >= n;
- num_beams > 1 cannot be combined with sampling;
- n / best_of / num_beams > 1 only without streaming (LMI returns best_of_sequences only whole);
- `null` parameter values mean "not set"; `stop` is accepted for `stop_sequences`, and a single
  string for a list; `watermark` and `grammar` (TGI's) are honoured, not with beam search;
- anything else unknown is rejected with the list of supported names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from lmi_serve import echo
from lmi_serve.dialects.common import guided
from lmi_serve.dialects.common.validation import field_problems
from lmi_serve.engine.policy import MAX_SEED, fit_to_context, sequence_seeds  # MAX_SEED: others import it here too
from lmi_serve.engine.types import GenerationRequest, GuidedDecoding, SamplingParams, StopParams
from lmi_serve.errors import InvalidRequest


class LmiRequestError(InvalidRequest, ValueError):
    """The payload does not fit the schema; the message says which field and why.

    An InvalidRequest, so each dialect renders it through its error table; also a ValueError,
    because the dynamic-batch path (`handler_utils.parse_batch`) answers a ValueError of one
    batch member with that member's own 424 instead of failing the whole batch."""


# Upper bound of the count fields (seeds are bounded by MAX_SEED, int64): larger values would
# overflow the engine's tensors (a 500 instead of a 4xx). Counts and token ids stay far below int32.
MAX_COUNT = 2**31 - 1

# The output formatters a request or option.output_formatter may name; `formatters.FORMATTERS`
# implements exactly these (a unit test checks). Listed here so the schema does not import its renderers.
OUTPUT_FORMATTERS = ("json", "jsonlines", "sse")


class DynamicBatchParameters(BaseModel):
    """GenerationParameters honoured by the dynamic-batch path (rolling_batch=disable)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    do_sample: bool | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    temperature: float | None = Field(None, ge=0)
    repetition_penalty: float = Field(1.0, gt=0)
    top_k: int = Field(0, ge=0, le=MAX_COUNT)
    top_p: float | None = Field(None, gt=0, le=1)
    max_new_tokens: int = Field(30, ge=1, le=MAX_COUNT)
    return_full_text: bool = False
    stop_sequences: list[str] | None = None
    ignore_eos_token: bool = False

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
    return echo.listing([f"{problem.where(prefix)}: {problem.message}" for problem in field_problems(error)])


def parse_dynamic_batch_request(payload: Any) -> DynamicBatchRequest:
    """Validate `{"inputs": str | [str], "parameters": {...}}`; unknown fields are rejected."""
    if isinstance(payload, str):
        payload = {"inputs": payload}
    if not isinstance(payload, dict):
        raise LmiRequestError("The request body must be a JSON object with an 'inputs' field")
    unknown = echo.unknown(payload, {"inputs", "parameters"})
    if unknown:
        raise LmiRequestError(f"Unsupported field(s) {echo.names(unknown)}: the dynamic-batch schema has 'inputs' and 'parameters'")
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
    unsupported = echo.unknown(raw, supported)
    if unsupported:
        raise LmiRequestError(
            f"Unsupported parameter(s) {echo.names(unsupported)} with dynamic batching (rolling_batch=disable); "
            f"supported: {sorted(supported)}")
    try:
        params = DynamicBatchParameters.model_validate(raw, strict=False)
    except ValidationError as exc:
        raise LmiRequestError(_describe(exc, "parameters")) from None
    return DynamicBatchRequest(prompts, params)


# --- rolling batch --------------------------------------------------------------------------

_SAMPLING_HINTS = "do_sample=true, or temperature > 0, top_k > 0, top_p < 1, typical_p < 1 or min_p > 0"


class GrammarParameter(BaseModel):
    """TGI's `grammar`: `{"type": "json", "value": <schema or JSON text>}` (`{}`: any object),
    `{"type": "regex", "value": <pattern>}`, `{"type": "json_schema", "value": {"name"?, "schema"}}`."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["json", "regex", "json_schema"]
    value: Any

    def guided(self) -> GuidedDecoding:
        where = "parameters.grammar.value"
        if self.type == "regex":
            return guided.regex(self.value, where)
        if self.type == "json_schema":
            if not isinstance(self.value, dict) or "schema" not in self.value:
                raise LmiRequestError(f"{where}: a json_schema grammar's value is {{\"name\", \"schema\"}}",
                                      param=where)
            return guided.json_schema(self.value["schema"], where + ".schema")
        return guided.json_schema(self.value, where)


class GenerationParameters(BaseModel):
    """GenerationParameters of the rolling-batch schema. `None` means "not set by the client"."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    do_sample: bool | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    temperature: float | None = Field(None, ge=0)
    repetition_penalty: float = Field(1.0, gt=0)
    top_k: int | None = Field(None, ge=-1, le=MAX_COUNT)  # 0 or -1: no top-k filter
    top_p: float | None = Field(None, gt=0, le=1)
    typical_p: float | None = Field(None, gt=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    max_new_tokens: int = Field(30, ge=1, le=MAX_COUNT)
    details: bool = False
    return_full_text: bool = False
    stop_sequences: list[str] | None = None
    decoder_input_details: bool = False
    top_n_tokens: int = Field(0, ge=0, le=20)
    ignore_eos_token: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_COUNT)]] | None = None
    include_stop_str_in_output: bool = False
    n: int = Field(1, ge=1, le=16)
    best_of: int | None = Field(None, ge=1, le=16)
    num_beams: int = Field(1, ge=1, le=8)
    truncate: int | None = Field(None, ge=1, le=MAX_COUNT)
    output_formatter: str | None = None
    watermark: bool = False  # TGI's watermark (engine/sampling/watermark.py), per row
    grammar: GrammarParameter | None = None
    # The LoRA adapter to generate with (LMI's name and shape: a string, or a list of one per input,
    # and rolling batch has one input); unset: the base model.
    adapters: str | list[str] | None = None

    @field_validator("adapters")
    @classmethod
    def _one_adapter(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError(f"one adapter per input, and a rolling-batch request has one input (got {len(value)})")
        if (value[0] if isinstance(value, list) else value) == "":
            raise ValueError("an adapter name must not be empty")
        return value

    @property
    def adapter(self) -> str | None:
        """The adapter's name, or None for the base model."""
        return self.adapters[0] if isinstance(self.adapters, list) else self.adapters

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty_stops(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not stop for stop in value):
            raise ValueError("stop sequences must be non-empty strings")
        return value

    @field_validator("output_formatter")
    @classmethod
    def _known_formatter(cls, value: str | None) -> str | None:
        if value is not None and value not in OUTPUT_FORMATTERS:
            raise ValueError(f"unknown output formatter {value!r}; choose one of {sorted(OUTPUT_FORMATTERS)}")
        return value

    @property
    def do_sample_resolved(self) -> bool:
        """Whether tokens are sampled: explicit `do_sample`, else inferred (module docstring)."""
        if self.temperature == 0:
            return False
        if self.do_sample is not None:
            return self.do_sample
        return ((self.temperature is not None and self.temperature > 0)
                or (self.top_k is not None and self.top_k > 0)
                or (self.top_p is not None and self.top_p < 1)
                or (self.typical_p is not None and self.typical_p < 1)
                or (self.min_p is not None and self.min_p > 0))

    @property
    def num_sequences(self) -> int:
        """How many sequences are generated: max(n, best_of)."""
        return max(self.n, self.best_of or 1)

    def sampling(self, seed: int | None) -> SamplingParams:
        do_sample = self.do_sample_resolved
        return SamplingParams(
            do_sample=do_sample,
            temperature=self.temperature if self.temperature else 1.0,
            top_k=max(self.top_k or 0, 0),
            top_p=self.top_p if self.top_p is not None else 1.0,
            typical_p=self.typical_p if self.typical_p is not None else 1.0,
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=seed if do_sample else None,
            watermark=self.watermark,
        )

    def stopping(self, max_new_tokens: int, eos_token_ids: frozenset[int]) -> StopParams:
        return StopParams(
            max_new_tokens=max_new_tokens,
            stop_sequences=tuple(self.stop_sequences or ()),
            stop_token_ids=frozenset(self.stop_token_ids or ()),
            eos_token_ids=frozenset(eos_token_ids),
            ignore_eos=self.ignore_eos_token,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


_ROLLING_FIELDS = ("inputs", "parameters", "stream", "adapters")


@dataclass(frozen=True)
class RollingRequest:
    inputs: str
    parameters: GenerationParameters
    stream: bool = False


def _normalise_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """`null` means unset; `stop` is another name for `stop_sequences`; one string is a list."""
    raw = {key: value for key, value in raw.items() if value is not None}
    if "stop" in raw:
        if "stop_sequences" in raw:
            raise LmiRequestError("parameters: give either 'stop_sequences' or 'stop', not both")
        raw["stop_sequences"] = raw.pop("stop")
    if isinstance(raw.get("stop_sequences"), str):
        raw["stop_sequences"] = [raw["stop_sequences"]]
    return raw


def _check_rules(params: GenerationParameters, stream: bool) -> None:
    """Rules that involve more than one field (see the module docstring)."""
    sampling = params.do_sample_resolved
    several = params.n > 1 or (params.best_of or 1) > 1
    if params.best_of is not None and params.best_of < params.n:
        raise LmiRequestError(f"parameters.best_of: must be >= n (got best_of={params.best_of}, n={params.n})")
    if params.num_beams > 1:
        if sampling:
            raise LmiRequestError("parameters.num_beams: beam search (num_beams > 1) cannot be combined with "
                                  "sampling; set do_sample=false and leave out temperature/top_k/top_p/typical_p/min_p")
        if stream:
            raise LmiRequestError("parameters.num_beams: beam search (num_beams > 1) is only supported for "
                                  "non-streaming requests (stream=false)")
    elif several and not sampling:
        raise LmiRequestError(f"parameters.n: n > 1 or best_of > 1 needs sampling ({_SAMPLING_HINTS})")
    if several and stream:
        raise LmiRequestError("parameters.n: n > 1 or best_of > 1 is only supported for non-streaming requests "
                              "(stream=false); LMI returns best_of_sequences only in a whole response")
    if params.grammar is not None and params.num_beams > 1:
        raise LmiRequestError("parameters.grammar: a grammar cannot be combined with beam search (num_beams > 1)",
                              param="parameters.grammar")
    if params.watermark and params.num_beams > 1:
        raise LmiRequestError("parameters.watermark: a watermark cannot be combined with beam search (num_beams > 1)",
                              param="parameters.watermark")


def parse_generation_parameters(raw: Any, *, stream: bool = False) -> GenerationParameters:
    """Validate a rolling-batch `parameters` object (absent / null: all defaults)."""
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise LmiRequestError("'parameters' must be a JSON object")
    raw = _normalise_parameters(raw)
    supported = set(GenerationParameters.model_fields)
    unsupported = echo.unknown(raw, supported)
    if unsupported:
        raise LmiRequestError(f"Unsupported parameter(s) {echo.names(unsupported)} with rolling batch; "
                              f"supported: {sorted(supported)}")
    try:
        params = GenerationParameters.model_validate(raw, strict=False)
    except ValidationError as exc:
        raise LmiRequestError(_describe(exc, "parameters")) from None
    _check_rules(params, stream)
    return params


def parse_rolling_request(payload: Any) -> RollingRequest:
    """Strict LMI rolling-batch schema: `{"inputs": str, "parameters": {...}, "stream": bool}`."""
    if not isinstance(payload, dict):
        raise LmiRequestError("The request body must be a JSON object such as "
                              '{"inputs": "...", "parameters": {...}}')
    unknown = echo.unknown(payload, _ROLLING_FIELDS)
    if unknown:
        raise LmiRequestError(f"Unsupported field(s) {echo.names(unknown)}: the rolling-batch schema has "
                              "'inputs', 'parameters', 'stream' and 'adapters'")
    if "inputs" not in payload:
        raise LmiRequestError("Missing required field 'inputs'")
    inputs = payload["inputs"]
    if isinstance(inputs, list):
        raise LmiRequestError("'inputs' must be a string, not a list: there is no client-side batching with "
                              "rolling batch; send one request per prompt")
    if not isinstance(inputs, str):
        raise LmiRequestError(f"'inputs' must be a string, not {type(inputs).__name__}")
    if not inputs:
        raise LmiRequestError("'inputs' must not be empty")
    stream = payload.get("stream")
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise LmiRequestError("'stream' must be true or false")
    parameters = payload.get("parameters")
    if payload.get("adapters") is not None:  # LMI takes the adapter beside `parameters` too
        if isinstance(parameters, dict) and parameters.get("adapters") is not None:
            raise LmiRequestError("give 'adapters' either at the top level or in 'parameters', not both")
        parameters = {**(parameters if isinstance(parameters, dict) else {}), "adapters": payload["adapters"]}
    return RollingRequest(inputs, parse_generation_parameters(parameters, stream=stream), stream)


def to_generation_requests(parameters: GenerationParameters, prompt_ids: Sequence[int], *,
                           eos_token_ids: frozenset[int], max_model_len: int,
                           max_input_len: int) -> list[GenerationRequest]:
    """Neutral requests for one rolling-batch request: one per sequence, max(n, best_of).

    1. `truncate` keeps the last N prompt ids; the prompt must then fit `max_input_len`.
    2. `max_new_tokens` is capped to what is left of `max_model_len` (`engine.policy.fit_to_context`,
       over="cap", as DJL does).
    3. Beam search (num_beams > 1) gives one request: the engine runs the beams itself.
    4. Seeds (`engine.policy.sequence_seeds`): sequence i uses base_seed + i, the base being the
       client's `seed` or one drawn for an unseeded sampled request. `requests[0].sampling.seed`
       is the base seed to report (e.g. TGI `details.seed`); it is None exactly when greedy.

    Every refusal is an InvalidRequest (`code` context_length_exceeded when the prompt does not
    fit), which each dialect renders through its own table.
    """
    prompt = tuple(prompt_ids)
    if parameters.truncate is not None:
        prompt = prompt[-parameters.truncate:]
    if 0 < len(prompt) <= max_input_len and len(prompt) >= max_model_len:
        # LMI's own wording for "no room"; the shared rule words it the OpenAI way.
        raise LmiRequestError(f"Input has {len(prompt)} tokens, which leaves no room to generate within "
                              f"the model's context of {max_model_len} tokens", code="context_length_exceeded")
    prompt, max_new_tokens = fit_to_context(prompt, parameters.max_new_tokens, max_model_len, over="cap",
                                            max_input_len=max_input_len)
    stop = parameters.stopping(max_new_tokens, eos_token_ids)
    constraint = parameters.grammar.guided() if parameters.grammar is not None else None
    count = 1 if parameters.num_beams > 1 else parameters.num_sequences
    seeds = sequence_seeds(parameters.seed, count, sampled=parameters.do_sample_resolved)
    return [
        GenerationRequest(
            prompt_ids=prompt,
            sampling=parameters.sampling(seed),
            stop=stop,
            top_n_tokens=parameters.top_n_tokens,
            prompt_logprobs=parameters.decoder_input_details,
            guided=constraint,
            adapter=parameters.adapter,
        )
        for seed in seeds
    ]
