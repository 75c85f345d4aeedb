"""The text-generation model as a Triton tensor model: its tensor contract and its sampling inputs.

The contract is a superset of Triton's vLLM and TensorRT-LLM models (see docs/triton.md): `text_input`
BYTES [1] plus optional tensors, `text_output` BYTES out. Sampling values come, lowest precedence
first, from the request parameters (vLLM reads every request parameter as a sampling parameter),
or instead from the `sampling_parameters` JSON string when that tensor is given (its numbers may be
strings, as genai-perf sends them), then from the dedicated tensors `max_tokens`, `temperature`,
`top_p`, `top_k` and `stop_words` (TensorRT-LLM style). Tokens are greedy unless a sampling value
asks otherwise (LMI's rule; vLLM would sample by default). The request parameter `adapter` names
the LoRA adapter to generate with (option.enable_lora).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from lmi_serve import echo, json_body
from lmi_serve.dialects.common.schema import GenerationParameters, to_generation_requests
from lmi_serve.dialects.common.validation import field_problems
from lmi_serve.engine.engine import Engine
from lmi_serve.engine.types import FinishReason, GenerationRequest, GenerationResult
from lmi_serve.errors import InvalidRequest
from lmi_serve.tensor_model import TensorSpec
from lmi_serve.tensors import WireTensor, as_wire_tensor

LLM_INPUTS = (
    TensorSpec("text_input", "BYTES", (1,)),
    TensorSpec("max_tokens", "INT32", (1,), optional=True),
    TensorSpec("temperature", "FP32", (1,), optional=True),
    TensorSpec("top_p", "FP32", (1,), optional=True),
    TensorSpec("top_k", "INT32", (1,), optional=True),
    TensorSpec("stream", "BOOL", (1,), optional=True),
    TensorSpec("sampling_parameters", "BYTES", (1,), optional=True),
    TensorSpec("exclude_input_in_output", "BOOL", (1,), optional=True),
    TensorSpec("stop_words", "BYTES", (-1,), optional=True),
    TensorSpec("return_finish_reason", "BOOL", (1,), optional=True),
    TensorSpec("return_num_input_tokens", "BOOL", (1,), optional=True),
    TensorSpec("return_num_output_tokens", "BOOL", (1,), optional=True),
)
LLM_OUTPUTS = (
    TensorSpec("text_output", "BYTES", (-1,)),
    TensorSpec("finish_reason", "BYTES", (-1,)),
    TensorSpec("num_input_tokens", "UINT32", (1,)),
    TensorSpec("num_output_tokens", "UINT32", (-1,)),
)
DEFAULT_MAX_TOKENS = 16  # vLLM's default

# Triton/vLLM sampling name -> GenerationParameters field. Anything else in `sampling_parameters` is
# refused; other request parameters are Triton request parameters this model does not read.
SAMPLING_NAMES = {
    "max_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
    "min_p": "min_p", "typical_p": "typical_p", "seed": "seed", "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "stop": "stop_sequences",
    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos_token",
    "include_stop_str_in_output": "include_stop_str_in_output",
}
_FIELD_NAMES = {field: name for name, field in SAMPLING_NAMES.items()}
# How the engine's finish reasons read on the wire (vLLM's words).
FINISH_REASONS = {FinishReason.LENGTH: "length", FinishReason.EOS_TOKEN: "stop",
                  FinishReason.STOP_SEQUENCE: "stop", FinishReason.CANCELLED: "abort", FinishReason.ERROR: "error"}
_RETURN_FLAGS = {"return_finish_reason": "finish_reason", "return_num_input_tokens": "num_input_tokens",
                 "return_num_output_tokens": "num_output_tokens"}


@dataclass
class LlmCall:
    """One parsed request to the text-generation model."""

    prompt: str
    request: GenerationRequest
    stream: bool
    exclude_input: bool
    extra_outputs: tuple[str, ...]  # optional outputs to return besides text_output
    text_shape: tuple[int, ...]  # text_output echoes text_input's rank: [1] or [1, 1]


def _scalar(tensors: dict[str, WireTensor], name: str) -> Any:
    tensor = tensors.get(name)
    if tensor is None:
        return None
    value = tensor.array.reshape(-1)[0]
    return value.item() if hasattr(value, "item") else value


def _text(value: Any, name: str) -> str:
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError:
        raise InvalidRequest(f"input '{name}' must be UTF-8 text") from None


def _sampling_source(tensors: dict[str, WireTensor], parameters: dict[str, Any]) -> dict[str, Any]:
    raw = _scalar(tensors, "sampling_parameters")
    if raw is None:
        return {SAMPLING_NAMES[k]: v for k, v in parameters.items() if k in SAMPLING_NAMES}
    try:
        values = json_body.loads(_text(raw, "sampling_parameters").strip() or "{}")
    except json_body.InvalidJson as exc:
        raise InvalidRequest(f"input 'sampling_parameters' must be a JSON object string: {exc.reason}") from None
    if not isinstance(values, dict):
        raise InvalidRequest("input 'sampling_parameters' must be a JSON object string")
    unknown = echo.unknown(values, SAMPLING_NAMES)
    if unknown:
        raise InvalidRequest(f"sampling_parameters: unsupported key(s) {echo.names(unknown)}; "
                             f"supported: {sorted(SAMPLING_NAMES)}")
    return {SAMPLING_NAMES[k]: v for k, v in values.items() if v is not None}


def _sampling_values(tensors: dict[str, WireTensor], parameters: dict[str, Any]) -> dict[str, Any]:
    values = _sampling_source(tensors, parameters)
    for name in ("max_tokens", "temperature", "top_p", "top_k"):
        if name in tensors:
            values[SAMPLING_NAMES[name]] = _scalar(tensors, name)
    if "stop_words" in tensors:  # TensorRT-LLM clients send "" for "no stop words"
        words = [_text(w, "stop_words") for w in tensors["stop_words"].array.reshape(-1)]
        values["stop_sequences"] = [w for w in words if w]
    stop = values.get("stop_sequences")
    values["stop_sequences"] = [stop] if isinstance(stop, str) else (stop or None)
    if isinstance(values.get("ignore_eos_token"), str):
        values["ignore_eos_token"] = values["ignore_eos_token"].lower() == "true"
    values.setdefault("max_new_tokens", DEFAULT_MAX_TOKENS)
    return values


def _parameters(values: dict[str, Any]) -> GenerationParameters:
    try:
        parameters = GenerationParameters.model_validate(values, strict=False)
    except ValidationError as exc:  # named as the client sent them (max_tokens, not max_new_tokens)
        problems = [f"{_FIELD_NAMES.get(p.field, p.field)}: {p.message} (got {echo.short(repr(p.input))})"
                    for p in field_problems(exc)]
        raise InvalidRequest("invalid sampling parameter: " + echo.listing(problems)) from None
    return parameters


def parse_llm_call(engine: Engine, tensors: dict[str, WireTensor], parameters: dict[str, Any],
                   requested_outputs: list[str] | None) -> LlmCall:
    """Tensors + request parameters -> one neutral GenerationRequest (validated, context-capped)."""
    prompt = _text(_scalar(tensors, "text_input"), "text_input")
    generation = _parameters(_sampling_values(tensors, parameters))
    adapter = parameters.get("adapter")  # the LoRA adapter to generate with: a request parameter
    if adapter is not None:
        if not isinstance(adapter, str) or not adapter:
            raise InvalidRequest("request parameter 'adapter' must be the name of a registered LoRA adapter")
        generation = generation.model_copy(update={"adapters": adapter})
    stream = bool(_scalar(tensors, "stream"))
    exclude = _scalar(tensors, "exclude_input_in_output")
    exclude = True if exclude is None else bool(exclude)
    extra = [output for flag, output in _RETURN_FLAGS.items() if _scalar(tensors, flag)]
    if requested_outputs is not None:  # asking for an output is enough to get it
        extra = [name for name in requested_outputs if name != "text_output"]
    (request,) = to_generation_requests(generation, engine.tokenizer(prompt).input_ids,  # refusals: InvalidRequest
                                        eos_token_ids=engine.eos_token_ids, max_model_len=engine.max_model_len,
                                        max_input_len=engine.max_model_len - 1)
    return LlmCall(prompt, request, stream, exclude, tuple(extra), tensors["text_input"].shape)


def llm_outputs(call: LlmCall, text: str, result: GenerationResult | None, *, final: bool,
                prepend_prompt: bool) -> list[WireTensor]:
    """The response tensors: `text_output`, then the asked-for extras on a final response."""
    import numpy as np

    if prepend_prompt:
        text = call.prompt + text
    tensors = [as_wire_tensor("text_output", "BYTES", np.array([text.encode("utf-8")], dtype=object)
                              .reshape(call.text_shape))]
    if not final or result is None:
        return tensors
    values = {"finish_reason": np.array([FINISH_REASONS.get(result.finish_reason, "")], dtype=object),
              "num_input_tokens": np.array([result.prompt_tokens], dtype=np.uint32),
              "num_output_tokens": np.array([result.generated_tokens], dtype=np.uint32)}
    datatypes = {spec.name: spec.datatype for spec in LLM_OUTPUTS}
    return tensors + [as_wire_tensor(name, datatypes[name], values[name]) for name in call.extra_outputs]
