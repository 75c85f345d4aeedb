"""Chat completions of reasoning models: `message.reasoning_content` / `delta.reasoning_content`.

The formatters in render.py see only the answer: each choice's events are re-issued with their
text cut to the answer part (`content_event`), so tool-call parsing and streaming work on the
answer alone, and the reasoning is added beside it. Token counts are untouched (every event keeps
its token); usage adds OpenAI's `completion_tokens_details.reasoning_tokens`. With vLLM's
`include_reasoning: false` the reasoning is generated but left out of the response.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from lmi_serve.dialects.common import reasoning
from lmi_serve.dialects.openai.generation import ChoiceState
from lmi_serve.engine.types import GenerationRequest, TokenEvent
from lmi_serve.errors import InvalidRequest


@dataclass(frozen=True)
class ReasoningSettings:
    """The model's options: option.reasoning_parser and option.max_reasoning_tokens."""

    parser: str = "auto"
    max_tokens: int | None = None


def reasoning_settings(config) -> ReasoningSettings:
    """A model's ReasoningSettings from its ModelConfig (defaults where it has none, e.g. a test double)."""
    return ReasoningSettings(getattr(config, "reasoning_parser", "auto"), getattr(config, "max_reasoning_tokens", None))


class ChatReasoning:
    """One chat request's reasoning handling, for all its choices."""

    def __init__(self, tokenizer, settings: ReasoningSettings | None, prompt: str, request):
        settings = settings or ReasoningSettings()
        self.markers = reasoning.markers(tokenizer, settings.parser)
        self.start = reasoning.start_state(prompt, self.markers)
        self.include = getattr(request, "include_reasoning", True)
        asked = getattr(request, "thinking_token_budget", None)
        if asked is not None and self.markers is not None and not self.markers.tokens:
            raise InvalidRequest("thinking_token_budget needs reasoning markers that are tokens of their own; "
                                 "this model writes them as plain text", param="thinking_token_budget")
        budgets = [b for b in (asked, settings.max_tokens) if b is not None]
        self.budget = min(budgets) if budgets and self.markers is not None and self.markers.tokens else None
        self._splitters: dict[int, reasoning.Splitter] = {}
        self._content: dict[int, ChoiceState] = {}

    @property
    def active(self) -> bool:
        """Whether the output may hold a block (else responses are as for any model)."""
        return self.markers is not None

    def constrain(self, requests: list[GenerationRequest]) -> list[GenerationRequest]:
        """Each request's grammar applying after the block (and the block bounded by the budget)."""
        if not self.active:
            return requests
        return [dataclasses.replace(r, guided=reasoning.wrap_grammar(r.guided, self.markers, self.start, self.budget))
                for r in requests]

    # ---- per choice -------------------------------------------------------------------------------

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the output must be decoded with special tokens kept (gpt-oss's and Gemma 4's
        channel markers are such tokens)."""
        return self.markers is not None and (self.markers.harmony or self.markers.special)

    def _splitter(self, index: int) -> reasoning.Splitter:
        if index not in self._splitters:
            self._splitters[index] = reasoning.splitter(self.markers, self.start)
        return self._splitters[index]

    def split_event(self, index: int, event: TokenEvent) -> tuple[str, TokenEvent]:
        """(reasoning text, the event with only its answer text) for the next event of choice `index`."""
        splitter = self._splitter(index)
        thought, content = splitter.feed(event.text, token=event.token_id >= 0)
        if event.finish_reason is not None:
            rest = splitter.finish()
            thought, content = thought + rest[0], content + rest[1]
        return thought, dataclasses.replace(event, text=content)

    def content_state(self, state: ChoiceState) -> ChoiceState:
        """The answer-only state of a choice, kept up to date by `stream_event`."""
        if state.index not in self._content:
            self._content[state.index] = ChoiceState(state.prompt_tokens, index=state.index)
        return self._content[state.index]

    def reasoning_tokens(self, states: Sequence[ChoiceState]) -> int:
        return sum(self._splitter(s.index).reasoning_tokens for s in states)

    # ---- whole bodies -----------------------------------------------------------------------------

    def split_states(self, states: Sequence[ChoiceState]) -> tuple[list[ChoiceState], list[str]]:
        """(answer-only states, each choice's reasoning) of finished choices."""
        content_states, thoughts = [], []
        for state in states:
            parts, content = [], self.content_state(state)
            for event in state.events:
                thought, event = self.split_event(state.index, event)
                parts.append(thought)
                content.events.append(event)
            content_states.append(content)
            thoughts.append("".join(parts))
        return content_states, thoughts

    def finish_body(self, body: dict, states: Sequence[ChoiceState], thoughts: Sequence[str]) -> dict:
        if not self.active:
            return body
        for choice, thought in zip(body["choices"], thoughts):
            if self.include:
                choice["message"]["reasoning_content"] = thought or None
        _add_details(body["usage"], self.reasoning_tokens(states))
        return body

    # ---- streams ----------------------------------------------------------------------------------

    def stream_event(self, stream, state: ChoiceState, event: TokenEvent) -> Iterator[dict]:
        """The chunks of `event` (already added to `state`): its reasoning as a `reasoning_content`
        delta, then what the chat stream makes of its answer part."""
        if not self.active:
            yield from stream.on_event(state, event)
            return
        thought, answer = self.split_event(state.index, event)
        if thought and self.include:
            yield stream._chunk([stream._choice(state.index, {"reasoning_content": thought})])
        content = self.content_state(state)
        content.events.append(answer)
        yield from stream.on_event(content, answer)

    def usage_chunk(self, chunk: dict, states: Sequence[ChoiceState]) -> dict:
        if self.active:
            _add_details(chunk["usage"], self.reasoning_tokens(states))
        return chunk


def _add_details(usage: dict, reasoning_tokens: int) -> None:
    usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
