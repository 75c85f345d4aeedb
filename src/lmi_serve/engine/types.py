"""Neutral request and event types: the only things that cross between dialects and the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.Enum):
    """Why a sequence ended. Dialects own the strings they show for these."""

    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"
    ERROR = "error"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. Neutral values switch a feature off for one row."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None  # None: a fresh random seed per request


@dataclass(frozen=True)
class StopParams:
    """When a sequence ends. `eos_token_ids` is filled from the model's generation config."""

    max_new_tokens: int = 30
    stop_sequences: tuple[str, ...] = ()
    eos_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    stop: StopParams = StopParams()


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. `text` is the newly released text (may be "" while held back, e.g. a
    partial UTF-8 character or a possible stop-string prefix); the last event carries `finish_reason`."""

    token_id: int
    text: str
    logprob: float
    special: bool
    finish_reason: FinishReason | None = None


@dataclass
class GenerationResult:
    """Everything one request produced, built from its events."""

    prompt_tokens: int
    events: list[TokenEvent] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(event.text for event in self.events)

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.events[-1].finish_reason if self.events else None

    @property
    def generated_tokens(self) -> int:
        return len(self.events)
