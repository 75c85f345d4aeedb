"""Chat and completions on one engine: parsed request in, a Reply (whole body or chunk stream) out.

Used by the /v1 routes and by /invocations (a body with `messages` is a chat request there). The
first event of a stream is awaited before the Reply exists, so failures before generation (queue
timeout, a prefill error) still get a real status code; later failures become an error chunk.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Literal

from lmi_serve.dialects.common import streaming
from lmi_serve.dialects.common.disconnect import wait_for_results
from lmi_serve.dialects.openai import chat, images, vllm
from lmi_serve.dialects.openai.errors import kind_body
from lmi_serve.dialects.openai.generation import ChoiceState, build_requests, check_token_ids, fit_to_context, submit
from lmi_serve.dialects.openai.reasoning import ChatReasoning, ReasoningSettings
from lmi_serve.dialects.openai.render import (ChatStream, CompletionChoice, ResponseMeta, chat_completion, completion,
                     completion_chunk)
from lmi_serve.dialects.openai.schema import ChatCompletionRequest, CompletionRequest
from lmi_serve.dialects.openai.templates import check_request_template
from lmi_serve.engine.engine import Engine
from lmi_serve.engine.generation import Generation
from lmi_serve.engine.types import DetokenizeParams, GenerationRequest, ImageInputs, TokenEvent
from lmi_serve.errors import GenerationFailed, InvalidRequest, ServingError

Chunk = dict


@dataclass
class Reply:
    """A whole JSON body, or chunks to frame as SSE (`data: ...` + `[DONE]`) or JSON lines."""

    body: dict | None = None
    chunks: Iterator[Chunk] | None = None

    def sse(self) -> Iterator[str]:
        return streaming.sse(self.chunks, done=True)

    def jsonlines(self) -> Iterator[str]:
        return streaming.jsonlines(self.chunks)


def _failed(event: TokenEvent) -> ServingError:
    """The failure `event` ended its sequence with, as its kind, once the response has begun (a
    failure before any token is raised by the Generation itself)."""
    kind = event.error_kind
    return kind(f"Generation failed: {event.error}" if kind is GenerationFailed else event.error)


def _results(generation: Generation, states: list[ChoiceState]) -> None:
    """Fill `states` from the generation (index-aligned); a sequence that failed fails the request."""
    for result, state in zip(wait_for_results(generation), states):  # cancelled if the client goes away
        state.events.extend(result.events)
    for state in states:
        if state.events and state.events[-1].error:
            raise _failed(state.events[-1])


def _guarded(chunks: Iterator[Chunk], generation: Generation) -> Iterator[Chunk]:
    """A failure after the first chunk (the status line is sent) becomes the stream's last chunk,
    an OpenAI error object; closing the stream cancels generation."""
    try:
        yield from chunks
    except ServingError as exc:
        yield kind_body(exc)
    finally:
        generation.close()


_KEEP_SPECIAL = DetokenizeParams(skip_special_tokens=False, spaces_between_special_tokens=False)


@dataclass
class PreparedChat:
    """A chat request made ready for the engine: its prompt ids, the new tokens it may generate, the
    sequences to queue, how its output splits into reasoning and answer, whether tool calls are parsed,
    and the alternatives reported per token."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    requests: list[GenerationRequest]
    thinking: ChatReasoning
    tools_enabled: bool
    top_logprobs: int = 0


class OpenAIService:
    def __init__(self, engine: Engine, model_name: str, adapter: str | None = None,
                 reasoning: ReasoningSettings | None = None, tool_call_parser: str | None = None, vision=None,
                 trust_request_template: bool = False):
        """`adapter`: the LoRA adapter the request's `model` named (vLLM's convention; responses then
        name it as their model), or None for the base model. `reasoning`: the model's reasoning options.
        `tool_call_parser`: the model's option.tool_call_parser (a tool_formats name), else the chat
        template decides. `vision`: a vision-language model's serving/vision.VisionInputs (its processor),
        None for a text model (image parts are then a 400). `trust_request_template`: the model's
        option.trust_request_chat_template (a request's `chat_template` is honoured, else a 400)."""
        self.engine, self.model_name, self.adapter = engine, adapter or model_name, adapter
        self.vision = vision
        self.trust_request_template = trust_request_template
        self.reasoning = reasoning
        self.tokenizer = engine.tokenizer
        self.tool_format = chat.tool_format_for(self.tokenizer, tool_call_parser)

    def _guided(self, request: ChatCompletionRequest):
        """The chat grammar, naming the tool-call markers the tokenizer holds as tokens."""
        return chat.guided_decoding(request, self.tool_format, self.tool_format.marker_tokens(self.tokenizer))

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # ---- chat ---------------------------------------------------------------------------------

    def chat_prompt(self, request: ChatCompletionRequest) -> tuple[str, list[int], ImageInputs | None]:
        """The conversation as the model reads it: the chat template's text, its token ids (each
        image placeholder expanded) and the images' tensors (None without images)."""
        if self.vision is None:
            images.refuse_images(images.image_parts(request))
        prompt_text = chat.render_prompt(self.tokenizer, request, tool_format=self.tool_format, vision=self.vision,
                                         request_template=check_request_template(request, self.trust_request_template))
        if self.vision is not None:
            ids, pictures = images.prompt_with_images(self.vision, prompt_text, request)
        else:
            ids, pictures = self.tokenizer(prompt_text, add_special_tokens=request.add_special_tokens).input_ids, None
        return prompt_text, ids, pictures

    def prepare_chat(self, request: ChatCompletionRequest, *,
                     over: Literal["refuse", "cap"] = "refuse") -> PreparedChat:
        """What the engine is asked for a chat request (nothing is queued yet). More tokens than the
        context leaves are refused (OpenAI's rule), or capped with `over="cap"`."""
        prompt_text, ids, pictures = self.chat_prompt(request)
        ids = vllm.truncate_prompt(ids, request, self.engine.max_model_len)
        prompt, max_tokens = fit_to_context(ids, request.requested_max_tokens, self.engine.max_model_len,
                                            where="messages", param="messages", over=over)
        top = request.top_logprobs or 0 if request.logprobs else 0
        thinking = ChatReasoning(self.tokenizer, self.reasoning, prompt_text, request)
        requests = thinking.constrain(build_requests(self.engine, request, prompt, max_tokens, count=request.n,
                                                     top_n=top, guided=self._guided(request),
                                                     adapter=self.adapter))
        if pictures is not None:  # every sequence of the request sees the same images
            requests = [replace(r, images=pictures) for r in requests]
        tools_enabled = bool(request.tools) and request.effective_tool_choice != "none"
        if thinking.keeps_special_tokens or (tools_enabled and self.tool_format.keeps_special_tokens):
            # The format's markers are special tokens its reader needs in the text (gpt-oss's channels).
            requests = [replace(r, detokenize=_KEEP_SPECIAL) for r in requests]
        return PreparedChat(prompt, max_tokens, requests, thinking, tools_enabled, top)

    def chat(self, request: ChatCompletionRequest) -> Reply:
        job = self.prepare_chat(request)
        prompt, thinking, top, tools_enabled = job.prompt, job.thinking, job.top_logprobs, job.tools_enabled
        generation = submit(self.engine, job.requests)
        meta = vllm.response_meta(ResponseMeta.new("chatcmpl", self.model_name), request)
        states = [ChoiceState(len(prompt), index=i) for i in range(request.n)]
        if not request.stream:
            _results(generation, states)
            answers, thoughts = thinking.split_states(states)  # the formatters see the answer alone
            body = chat_completion(meta, answers, logprobs=request.logprobs, top_logprobs=top,
                                   tools_enabled=tools_enabled, token_text=self.token_text,
                                   tool_format=self.tool_format)
            return Reply(body=vllm.finish_chat(thinking.finish_body(body, states, thoughts), request, states))
        generation.start()  # a failure before the first token raises here, before any status line
        stream = ChatStream(meta, include_usage=request.include_usage, logprobs=request.logprobs, top_logprobs=top,
                            tools_enabled=tools_enabled, token_text=self.token_text, tool_format=self.tool_format)

        def chunks() -> Iterator[Chunk]:
            for index, event in generation.events():
                if event.error:
                    raise _failed(event)
                yield from stream.start(index)
                states[index].events.append(event)
                yield from thinking.stream_event(stream, states[index], event)
            if request.include_usage:
                yield thinking.usage_chunk(stream.usage_chunk(states), states)

        return Reply(chunks=_guarded(_with_running_usage(vllm.echo_chunks(chunks(), request), request, len(prompt),
                                                         states), generation))

    # ---- completions --------------------------------------------------------------------------

    def _prompt_ids(self, prompt: str | list[int], request: CompletionRequest) -> list[int]:
        if isinstance(prompt, list):
            if request.use_raw_prompt is False:
                raise InvalidRequest("use_raw_prompt=false applies the chat template to text; a token-id prompt "
                                     "is used as given", param="use_raw_prompt")
            check_token_ids(prompt, self.engine.vocab_size, "prompt")
            return prompt
        if request.use_raw_prompt is False:  # the one transformation we know: the chat template
            if not getattr(self.tokenizer, "chat_template", None):
                raise InvalidRequest("use_raw_prompt=false needs a chat template, which this model lacks",
                                     param="use_raw_prompt")
            prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                        add_generation_prompt=True)
            return self.tokenizer(prompt, add_special_tokens=False).input_ids
        return self.tokenizer(prompt, add_special_tokens=request.add_special_tokens).input_ids

    def completions(self, request: CompletionRequest) -> Reply:
        per_prompt = request.best_of or request.n
        choices: list[CompletionChoice] = []
        requests: list[GenerationRequest] = []
        prompt_tokens = 0
        for p, prompt in enumerate(request.prompts):
            ids = vllm.truncate_prompt(self._prompt_ids(prompt, request), request, self.engine.max_model_len)
            ids, max_tokens = fit_to_context(ids, request.max_tokens, self.engine.max_model_len, where="prompt",
                                             param="prompt", truncate=request.error_behavior == "truncate")
            prompt_tokens += len(ids)
            text = self.tokenizer.decode(ids) if request.echo else ""  # after any truncation
            requests += build_requests(self.engine, request, ids, max_tokens, count=per_prompt,
                                       top_n=request.logprobs or 0,
                                       prompt_logprobs=request.echo and request.logprobs is not None,
                                       adapter=self.adapter)
            choices += [CompletionChoice(ChoiceState(len(ids), index=p * per_prompt + j), text, request.echo,
                                         request.suffix) for j in range(per_prompt)]
        generation = submit(self.engine, requests)  # every prompt's sequences, all or none
        meta = vllm.response_meta(ResponseMeta.new("cmpl", self.model_name), request)
        if not request.stream:
            _results(generation, [c.state for c in choices])
            choices = _best_of(choices, request.n, per_prompt)
            return Reply(body=vllm.finish_completion(completion(
                meta, choices, logprobs=request.logprobs, token_text=self.token_text, prompt_tokens=prompt_tokens),
                request, [c.state for c in choices]))
        generation.start()  # a failure before the first token raises here, before any status line

        def chunks() -> Iterator[Chunk]:
            for index, event in generation.events():
                choice = choices[index]
                first = not choice.state.events
                choice.state.events.append(event)
                if event.error:
                    raise _failed(event)
                chunk = completion_chunk(meta, choice, event, first=first, logprobs=request.logprobs,
                                         token_text=self.token_text, include_usage=request.include_usage)
                if chunk is not None:
                    yield chunk
            if request.include_usage:
                generated = sum(c.state.generated for c in choices)
                yield {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
                       "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                                                "total_tokens": prompt_tokens + generated}}

        return Reply(chunks=_guarded(_with_running_usage(chunks(), request, prompt_tokens,
                                                         [c.state for c in choices]), generation))


def _with_running_usage(chunks: Iterator[Chunk], request, prompt_tokens: int,
                        states: list[ChoiceState]) -> Iterator[Chunk]:
    """vLLM's `stream_options.continuous_usage_stats` (with `include_usage`, as vLLM requires): every
    chunk carries the usage so far, counted when the chunk is taken from `chunks`."""
    if not (request.include_usage and request.stream_options.continuous_usage_stats):
        yield from chunks
        return
    for chunk in chunks:
        if chunk.get("usage") is None and "choices" in chunk:
            generated = sum(s.generated for s in states)
            chunk["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                              "total_tokens": prompt_tokens + generated}
        yield chunk


def _best_of(choices: list[CompletionChoice], n: int, per_prompt: int) -> list[CompletionChoice]:
    """With best_of > n: the n sequences of each prompt with the highest cumulative logprob,
    re-indexed prompt * n + j as if only n had been generated."""
    if per_prompt == n:
        return choices
    kept = []
    for p in range(len(choices) // per_prompt):
        group = choices[p * per_prompt:(p + 1) * per_prompt]
        group.sort(key=lambda c: sum(e.logprob for e in c.state.events if e.token_id >= 0), reverse=True)
        for j, choice in enumerate(group[:n]):
            choice.state.index = p * n + j
            kept.append(choice)
    return kept

