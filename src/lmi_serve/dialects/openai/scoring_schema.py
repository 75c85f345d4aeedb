"""vLLM's scoring bodies (/score, /rerank, /classify): the requests as validated pydantic models, the
pairing rules, and the responses' shapes (for /openapi.json).

Requests follow vLLM's protocol: `use_activation` (and its older spellings `softmax`, `activation`)
false gives raw logits; `truncate_prompt_tokens` may only be -1 (inputs are always cut at the model's
limit); a `priority` is refused. /rerank also takes Cohere's and Jina's `documents` objects
(`{"text": ...}`) and `return_documents` (default true, as vLLM always returns them).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, Field, StrictStr, field_validator

from lmi_serve.dialects.openai.schema import _Lenient
from lmi_serve.errors import InvalidRequest

_PRIORITY = ("requests are served first come, first served; there is no priority scheduling", (None, 0))
_TRUNCATE = ("inputs are always cut at the model's limit (-1); another length is not supported", (None, -1))


class _ScoringFields(_Lenient):
    vllm_refused: ClassVar[dict[str, tuple[str, tuple]]] = {"priority": _PRIORITY,
                                                            "truncate_prompt_tokens": _TRUNCATE}

    model: str | None = None
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None
    softmax: bool | None = None  # vLLM's older spellings of use_activation
    activation: bool | None = None
    priority: int | None = None
    user: str | None = None

    @property
    def activated(self) -> bool:
        """vLLM's rule: use_activation, else softmax, else activation, else true."""
        for value in (self.use_activation, self.softmax, self.activation):
            if value is not None:
                return value
        return True


class ScoreRequest(_ScoringFields):
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]

    def pairs(self) -> list[tuple[str, str]]:
        """vLLM's pairing: 1:1, 1:N (text_1 repeated) or N:N; anything else is a 400 naming the field."""
        first = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        second = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if not first:
            raise InvalidRequest("text_1: at least one text must be given", param="text_1")
        if not second:
            raise InvalidRequest("text_2: at least one text must be given", param="text_2")
        if len(first) > 1 and len(first) != len(second):
            raise InvalidRequest(f"text_1 has {len(first)} texts and text_2 {len(second)}: input lengths must "
                                 "be 1:1, 1:N or N:N", param="text_2")
        return list(zip(first * len(second) if len(first) == 1 else first, second))


class RerankDocument(BaseModel):
    text: StrictStr


class RerankRequest(_ScoringFields):
    query: StrictStr
    documents: list[StrictStr | RerankDocument]
    top_n: int | None = Field(None, ge=0, description="the best top_n results; 0 or absent: every document")
    return_documents: bool = True

    @field_validator("documents")
    @classmethod
    def _some_documents(cls, value):
        if not value:
            raise ValueError("documents must not be empty")
        return value

    @property
    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ClassifyRequest(_ScoringFields):
    input: StrictStr | list[StrictStr]

    @field_validator("input")
    @classmethod
    def _some_input(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("input must not be an empty list")
        return value

    @property
    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


# --- responses (documentation: the routes build plain dicts in these shapes) ----------------------

class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0
    prompt_tokens_details: None = None


class ScoreData(BaseModel):
    index: int
    object: Literal["score"]
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankResult(BaseModel):
    index: int = Field(description="the document's position in the request")
    document: RerankDocument | None = Field(None, description="absent with return_documents=false")
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult] = Field(description="sorted by relevance_score, highest first")


class ClassifyData(BaseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassifyResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ClassifyData]
    usage: PoolingUsage
