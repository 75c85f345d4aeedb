"""Models that only describe bodies for /openapi.json: request envelopes that routes parse by hand
around the validated `GenerationParameters`, and the response and error shapes the dialects build
as dicts. Nothing validates with them; fields not listed here may appear (`extra="allow"`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel

from lmi_serve.dialects.common.schema import DynamicBatchParameters, GenerationParameters


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class JsonObject(_Open):
    """A JSON object (see the dialect's own documentation for its fields)."""


# ---- errors, one shape per dialect -------------------------------------------------------------

class LmiError(_Open):
    code: int
    type: str | None = None
    message: str
    error: str | None = None


class TgiError(BaseModel):
    error: str
    error_type: str


class OpenAIErrorObject(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIError(BaseModel):
    error: OpenAIErrorObject


class TritonError(BaseModel):
    error: str


class AnthropicErrorObject(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorObject


# ---- LMI ----------------------------------------------------------------------------------------

class LmiRequest(_Open):
    """The rolling-batch schema (the default for text generation)."""

    inputs: str
    parameters: GenerationParameters | None = None
    stream: bool = False


class LmiDynamicBatchRequest(BaseModel):
    """The dynamic-batch schema (option.rolling_batch=disable); also an embedding request."""

    inputs: str | list[str]
    parameters: DynamicBatchParameters | None = None


class LmiGeneration(_Open):
    generated_text: str
    details: dict[str, Any] | None = None


class PingResponse(RootModel[dict[str, dict[str, str]]]):
    """`{"<model>": {"status": "Healthy" | "Loading" | "Failed", "error"?}}`."""


class ExecutionParameters(BaseModel):
    """SageMaker Batch Transform's defaults for a job that leaves them unset."""
    MaxConcurrentTransforms: int
    BatchStrategy: str
    MaxPayloadInMB: int


class LmiModel(_Open):
    modelName: str
    modelUrl: str | None = None
    status: str


class LmiModelList(BaseModel):
    models: list[LmiModel]
    nextPageToken: str | None = None  # while more models remain (the next call's `next_page_token`)


class LoadModelRequest(BaseModel):
    """SageMaker multi-model endpoints' load call (dialects/lmi/models_api.py)."""

    model_config = ConfigDict(extra="forbid")
    model_name: str
    url: str


class LmiWorkflow(_Open):
    workflowName: str
    models: list[LmiModel]


class LmiAdapter(_Open):
    """One LoRA adapter of a model (dialects/lmi/adapters.py)."""

    name: str
    src: str
    pin: bool
    rank: int
    alpha: float
    targetModules: list[str]
    baseModel: str | None = None
    resident: bool
    slot: int | None = None
    activeRequests: int
    requests: int
    loads: int


class LmiAdapterList(BaseModel):
    adapters: list[LmiAdapter]
    nextPageToken: str | None = None


class LmiStatus(BaseModel):
    status: str


class LmiModelDescription(RootModel[list[LmiWorkflow]]):
    """LMI's description, with batching and engine counters."""


# ---- TGI ----------------------------------------------------------------------------------------

class TgiRequest(BaseModel):
    """TGI's GenerateRequest: the LMI rolling-batch parameters with TGI's stricter rules."""

    inputs: str = Field(min_length=1)
    parameters: GenerationParameters | None = None
    stream: bool = False


class TgiGenerateResponse(_Open):
    generated_text: str
    details: dict[str, Any] | None = None


class TgiStreamToken(_Open):
    id: int
    text: str
    logprob: float | None = None
    special: bool


class TgiStreamResponse(_Open):
    index: int
    token: TgiStreamToken
    generated_text: str | None = None
    details: dict[str, Any] | None = None


class TgiInfo(_Open):
    model_id: str
    max_input_tokens: int
    max_total_tokens: int
    version: str


class TgiToken(BaseModel):
    id: int
    text: str
    start: int = Field(description="character offset into `inputs`")
    stop: int


class TgiTokenList(RootModel[list[TgiToken]]):
    """TGI's /tokenize answer."""


# ---- OpenAI -------------------------------------------------------------------------------------

class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int


class ChatChoice(_Open):
    index: int
    message: dict[str, Any]
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class ChatCompletion(_Open):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(_Open):
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class Completion(_Open):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 of little-endian float32")


class EmbeddingList(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: Usage


class OpenAIModel(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class OpenAIModelList(BaseModel):
    object: Literal["list"]
    data: list[OpenAIModel]


class ResponseUsage(_Open):
    input_tokens: int
    output_tokens: int
    output_tokens_details: dict[str, int] = Field(description="`reasoning_tokens`: those among the output tokens")
    total_tokens: int


class ResponseObject(_Open):
    """A Response of the Responses API (openai.types.responses.Response): `output` holds `reasoning`,
    `function_call` and assistant `message` items; the request's settings are echoed beside it."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: ResponseUsage | None = None


class ResponseStreamEvent(_Open):
    """One event of a Responses stream, sent as `event: <type>` + `data: <this>`: `response.created`,
    `response.output_item.added`, `response.output_text.delta`, ..., `response.completed`."""

    type: str
    sequence_number: int


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response.deleted"]
    deleted: bool


# ---- Triton / KServe v2 -------------------------------------------------------------------------

class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(_Open):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class ModelStats(BaseModel):
    model_stats: list[dict[str, Any]]


class RepositoryIndexRequest(BaseModel):
    ready: bool = False


class RepositoryModel(_Open):
    name: str
    version: str
    state: str
    reason: str | None = None


class RepositoryIndex(RootModel[list[RepositoryModel]]):
    """Every model and its state."""


class InferInputTensor(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = Field(None, description="absent with the binary tensor data extension")


class RequestedOutput(BaseModel):
    name: str
    parameters: dict[str, Any] | None = None


class InferRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[InferInputTensor]
    outputs: list[RequestedOutput] | None = None


class InferOutputTensor(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class InferResponse(BaseModel):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[InferOutputTensor]


# ---- Anthropic ----------------------------------------------------------------------------------

class AnthropicUsage(_Open):
    input_tokens: int
    output_tokens: int


class AnthropicMessage(_Open):
    """A whole message; a stream sends Anthropic's events (message_start ... message_stop) instead."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]] = Field(description="text, thinking and tool_use blocks")
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"]
    stop_sequence: str | None
    usage: AnthropicUsage


class AnthropicTokenCount(BaseModel):
    input_tokens: int
