"""Neutral request and event types: the only things that cross between dialects and the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from lmi_serve.errors import GenerationFailed, ServingError


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
    typical_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # on prompt + generated tokens (HF / TGI semantics)
    presence_penalty: float = 0.0  # on generated tokens (OpenAI semantics)
    frequency_penalty: float = 0.0  # on generated tokens, times their count
    seed: int | None = None  # None: a fresh random seed per request
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the scores
    allowed_token_ids: frozenset[int] | None = None  # None: every token; else only these may be chosen
    # Token sequences that must not be generated: the last token of one is banned at a step where the
    # tokens generated just before equal the rest of it (a one-token sequence is always banned).
    banned_sequences: tuple[tuple[int, ...], ...] = ()
    # Watermark the output (engine/sampling/watermark.py): a green list seeded by the previous token gets a bias.
    watermark: bool = False

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True)
class GuidedDecoding:
    """Constrain the output to a grammar: a JSON Schema (JSON text), a Lark grammar (llguidance's
    dialect, which may embed `%json{...}` schemas) or a regular expression (llguidance's syntax,
    matched against the whole output). Exactly one is set."""

    json_schema: str | None = None
    lark: str | None = None
    regex: str | None = None


@dataclass(frozen=True)
class StopParams:
    """When a sequence ends. `eos_token_ids` is filled from the model's generation config."""

    max_new_tokens: int = 30
    # Until this many tokens are generated, EOS and stop_token_ids cannot be chosen and stop strings
    # are not looked for (a finished grammar still ends the sequence).
    min_new_tokens: int = 0
    stop_sequences: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    eos_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False


@dataclass(frozen=True)
class DetokenizeParams:
    """How generated tokens become text."""

    skip_special_tokens: bool = True
    # With special tokens shown: False writes two special tokens in a row as their bare text, with
    # no space the tokenizer's decoder might put between them.
    spaces_between_special_tokens: bool = True


@dataclass(frozen=True)
class ImageInputs:
    """A prompt's images, already turned into the model's input tensors by its processor (outside the
    engine), with the prompt's placeholder tokens expanded to match. `tensors` are the extra keyword
    arguments of the prompt's prefill forward, by name (`pixel_values`, and per family e.g.
    `pixel_attention_mask`, `image_sizes`), each with a leading batch dimension of one prompt.
    `digest` identifies the image bytes (equality and hashing use it, never the tensors)."""

    tensors: tuple[tuple[str, Any], ...] = field(compare=False)
    digest: str
    count: int = 1  # images in the prompt

    def named(self) -> dict[str, Any]:
        return dict(self.tensors)


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    stop: StopParams = StopParams()
    top_n_tokens: int = 0  # alternatives reported per generated token
    prompt_logprobs: bool = False  # report each prompt token's logprob (decoder_input_details)
    prompt_top_n: int = 0  # with prompt_logprobs: alternatives reported per prompt token
    guided: GuidedDecoding | None = None  # constrained decoding (structured output, tool calls)
    detokenize: DetokenizeParams = DetokenizeParams()
    adapter: str | None = None  # the registered LoRA adapter to generate with (engine/adapters.py); None: the base
    # The prompt's images (a vision-language model): its prefill runs whole and alone, never from or into
    # the prefix cache (prefill.py). None: a text prompt.
    images: ImageInputs | None = None


@dataclass(frozen=True)
class TopToken:
    """A token with its logprob: an alternative at one step, or one prompt token."""

    token_id: int
    text: str
    logprob: float | None
    special: bool = False
    rank: int | None = None  # 1 for the most likely token at that position; None where not computed


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. `text` is the newly released text (may be "" while held back, e.g. a
    partial UTF-8 character or a possible stop-string prefix); the last event carries
    `finish_reason`. A failed request ends with an event of token_id -1, ERROR and `error`; a
    cancelled one with token_id -1 and CANCELLED."""

    token_id: int
    text: str
    logprob: float
    special: bool
    finish_reason: FinishReason | None = None
    top_tokens: tuple[TopToken, ...] = ()
    prompt_tokens: tuple[TopToken, ...] | None = None  # on the first event, when prompt_logprobs
    # On the first event, when prompt_top_n: each prompt position's best alternatives (none for the first).
    prompt_top_tokens: tuple[tuple[TopToken, ...], ...] | None = None
    error: str | None = None
    error_kind: type[ServingError] = GenerationFailed  # with `error`: which kind of failure ended it
    stop_sequence: str | None = None  # with STOP_SEQUENCE: the stop string that ended it (Anthropic names it)
    # With LENGTH: the request's generation deadline ended it (Engine `generation_deadline`), not its token limit.
    deadline_cut: bool = False

    @classmethod
    def failure(cls, message: str, kind: type[ServingError] = GenerationFailed) -> "TokenEvent":
        return cls(-1, "", -1.0, True, FinishReason.ERROR, error=message, error_kind=kind)

    def raise_failure(self) -> None:
        """Raise this event's failure as its kind, if it is one."""
        if self.error is not None:
            raise self.error_kind(self.error)

    @classmethod
    def deadline_reached(cls, text: str = "") -> "TokenEvent":
        """Ends a request its generation deadline caught without a new token (waiting for a row, or
        prefilling): LENGTH with `deadline_cut`, and `text` the detokenizer still held, if any."""
        return cls(-1, text, 0.0, False, FinishReason.LENGTH, deadline_cut=True)

    @classmethod
    def cancelled(cls) -> "TokenEvent":
        """Ends a cancelled request's stream, so anything still reading it (a helper thread) stops."""
        return cls(-1, "", 0.0, True, FinishReason.CANCELLED)


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
    def error(self) -> str | None:
        return self.events[-1].error if self.events else None

    @property
    def deadline_cut(self) -> bool:
        """The generation deadline ended it (finish_reason LENGTH)."""
        return bool(self.events) and self.events[-1].deadline_cut

    @property
    def tokens(self) -> list[TokenEvent]:
        """Generated tokens, without a failure marker."""
        return [e for e in self.events if e.token_id >= 0]

    @property
    def generated_tokens(self) -> int:
        return len(self.tokens)

    @property
    def cumulative_logprob(self) -> float:
        return sum(e.logprob for e in self.tokens)
