"""The LMI rolling-batch schema on the engine: one request Input -> one Output (whole or streamed).

Path: parse (schema or a model.py @input_formatter) -> tokenize -> GenerationRequests (n/best_of
sequences) -> engine.submit -> events -> the chosen formatter renders them. The first event of a
stream is awaited before the Output is returned, so errors before generation starts still get a
real status code; later errors become the formatter's final error line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from ...disconnect import wait_for_results
from ...engine.engine import Engine
from ...engine.generation import Generation
from ...engine.types import GenerationRequest, GenerationResult
from ...errors import GenerationFailed, Overloaded
from ...handler_api import Input, Output
from ...handler_utils import read_payload
from ..openai.errors import OpenAIError
from ..openai.schema import ChatCompletionRequest
from ..openai.schema import parse as parse_openai
from ..openai.service import OpenAIService
from .formatters import OutputFormatter, RenderContext, choose_formatter
from .hooks import apply_input_formatter, custom_formatter
from .schema import LmiRequestError, RollingRequest, parse_rolling_request, to_generation_requests


def best_first(results: Sequence[GenerationResult], n: int) -> list[GenerationResult]:
    """Sequences by cumulative logprob, best first: the best `n` when n > 1 (vLLM's n of best_of),
    else all of them (TGI's best_of: the others become best_of_sequences)."""
    return [results[i] for i in _ranking(results, n)]


def _ranking(results: Sequence[GenerationResult], n: int) -> list[int]:
    """The indices of `results` in `best_first` order."""
    ranked = sorted(range(len(results)), key=lambda i: results[i].cumulative_logprob, reverse=True)
    return ranked[:n] if n > 1 else ranked


def rank_with_seeds(ctx: RenderContext, requests: Sequence[GenerationRequest], results: Sequence[GenerationResult],
                    n: int) -> tuple[RenderContext, list[GenerationResult]]:
    """`best_first(results, n)`, and `ctx` reporting each ranked sequence's own sampling seed
    (`requests[i]` produced `results[i]`): the best one's as `seed`, the others' as `other_seeds`."""
    order = _ranking(results, n)
    seeds = [requests[i].sampling.seed for i in order]
    return replace(ctx, seed=seeds[0], other_seeds=tuple(seeds[1:])), [results[i] for i in order]


def _any_failed(results: Sequence[GenerationResult]) -> bool:
    return any(r.finish_reason is not None and r.error for r in results)


class RollingBatchService:
    def __init__(self, engine: Engine, *, max_input_len: int, tgi_compat: bool = False,
                 output_formatter: str | None = None, custom_input: Callable | None = None,
                 custom_output: Callable | None = None, model_name: str = "model"):
        self.engine = engine
        self.model_name = model_name
        self.max_input_len = max_input_len
        self.tgi_compat = tgi_compat
        self.output_formatter = output_formatter
        self.custom_input = custom_input
        self.custom_output = custom_output

    def _error(self, message: str, code: int = 424, error_type: str = "validation") -> Output:
        """LMI: `{"error", "code"}` with 424; tgi_compat: TGI's `{"error", "error_type"}` and codes."""
        if self.tgi_compat:
            status = {"validation": 422, "generation": 424, "overloaded": 429}.get(error_type, code)
            body = {"error": message, "error_type": error_type}
        else:
            status, body = code, {"error": message, "code": code}
        return Output(code=status, message="invoke handler failure").add(body)

    def _parse(self, item: Input) -> RollingRequest:
        if self.custom_input is not None:
            return apply_input_formatter(self.custom_input, item)
        payload = read_payload(item)
        return parse_rolling_request({"inputs": payload} if isinstance(payload, str) else payload)

    def inference(self, item: Input) -> Output:
        if self.custom_input is None:
            try:
                payload = read_payload(item)
            except ValueError as exc:
                return self._error(str(exc))
            if isinstance(payload, dict) and "messages" in payload:
                return self._chat(item, payload)
        try:
            request = self._parse(item)
            custom = (custom_formatter(self.custom_output, stream=request.stream)
                      if self.custom_output is not None else None)
            formatter = choose_formatter(request.parameters.output_formatter, self.output_formatter,
                                         request.stream, self.tgi_compat, custom=custom)
            prompt_ids = self.engine.tokenizer(request.inputs).input_ids
            requests = to_generation_requests(request.parameters, prompt_ids,
                                              eos_token_ids=self.engine.eos_token_ids,
                                              max_model_len=self.engine.max_model_len,
                                              max_input_len=self.max_input_len)
        except (LmiRequestError, ValueError, KeyError) as exc:
            return self._error(str(exc))
        ctx = RenderContext.for_request(request, tgi_compat=self.tgi_compat, seed=requests[0].sampling.seed,
                                        prompt_tokens_count=len(requests[0].prompt_ids))
        if request.parameters.num_beams > 1:
            return self._beams(ctx, formatter, requests[0], request.parameters)
        try:
            generation = self.engine.generate(requests)
        except Overloaded:
            if self.tgi_compat:
                return self._error("Model is overloaded", 429, "overloaded")
            raise  # the LMI front answers 503
        if formatter.streams(request.stream):
            return self._stream(ctx, formatter, generation)
        return self._whole(ctx, formatter, generation, request.parameters.n)

    def _chat(self, item: Input, payload: dict) -> Output:
        """LMI's chat schema: an OpenAI chat request; the same chat.completion object back, and a
        stream of chat.completion.chunk objects as JSON lines (SSE with [DONE] when the client
        accepts text/event-stream or option.output_formatter=sse)."""
        chat = OpenAIService(self.engine, self.model_name)
        try:
            reply = chat.chat(parse_openai(ChatCompletionRequest, payload))
        except OpenAIError as exc:
            if exc.status == 429:
                raise Overloaded(exc.message) from None
            return self._error(exc.message, error_type="generation" if exc.status >= 500 else "validation")
        if reply.chunks is None:
            return Output().add(reply.body).add_property("Content-Type", "application/json")
        wants_sse = ("text/event-stream" in (item.get_property("Accept") or "")
                     or self.output_formatter == "sse")
        if wants_sse:
            return Output().add_property("Content-Type", "text/event-stream").add_stream_content(
                reply.sse(), output_formatter=lambda chunk: chunk)
        return Output().add_property("Content-Type", "application/jsonlines").add_stream_content(
            reply.jsonlines(), output_formatter=lambda chunk: chunk)

    def _beams(self, ctx: RenderContext, formatter: OutputFormatter, request, parameters) -> Output:
        try:
            results = self.engine.beam_search(request, parameters.num_beams)
        except Overloaded:
            if self.tgi_compat:
                return self._error("Model is overloaded", 429, "overloaded")
            raise
        except Exception as exc:  # a failed beam search fails this request only
            return self._error(f"exception occurred during beam search: {exc}", error_type="generation")
        return self._render_whole(ctx, formatter, best_first(results, parameters.n), _any_failed(results))

    def _whole(self, ctx: RenderContext, formatter: OutputFormatter, generation: Generation, n: int) -> Output:
        try:
            results = wait_for_results(generation)  # cancelled if the client goes away meanwhile
        except GenerationFailed as exc:  # failed before any token: LMI's handler-failure answer
            return self._error(exc.message, error_type="generation")
        ranked_ctx, ranked = rank_with_seeds(ctx, generation.requests, results, n)
        return self._render_whole(ranked_ctx, formatter, ranked, _any_failed(results))

    @staticmethod
    def _render_whole(ctx: RenderContext, formatter: OutputFormatter, ranked: list[GenerationResult],
                      failed: bool) -> Output:
        """`ranked`: the sequences to show, best first; `failed`: whether any sequence failed."""
        best, others = ranked[0], [r.events for r in ranked[1:]]
        body = formatter.render_body(ctx, best.events, others)
        output = Output(code=424 if failed else 200, message="invoke handler failure" if failed else "OK")
        return output.add(body).add_property("Content-Type", formatter.mimetype)

    def _stream(self, ctx: RenderContext, formatter: OutputFormatter, generation: Generation) -> Output:
        try:
            generation.start()  # a failure before any token still gets a real status code
        except GenerationFailed as exc:
            return self._error(exc.message, error_type="generation")
        output = Output().add_property("Content-Type", formatter.mimetype)
        return output.add_stream_content(_render_stream(ctx, formatter, generation),
                                         output_formatter=lambda chunk: chunk)


def _render_stream(ctx: RenderContext, formatter: OutputFormatter, generation: Generation) -> Iterator[str]:
    """Chunks for each event; closing this generator (client gone) cancels the engine request."""
    events = []
    for _, event in generation.events():
        events.append(event)
        yield formatter.render_chunk(ctx, events)
