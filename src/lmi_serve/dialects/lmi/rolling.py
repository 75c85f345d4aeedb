"""The LMI rolling-batch schema on the engine: one request Input -> one Output (whole or streamed).

Path: parse (schema or a model.py @input_formatter) -> tokenize -> GenerationRequests (n/best_of
sequences) -> engine.generate -> events -> the chosen formatter renders them. The first event of a
stream is awaited before the Output is returned, so errors before generation starts still get a
real status code; later errors become the formatter's final error line.

Errors: every step raises the core's kinds (errors.py); `inference` turns them into the handler's
Output in one place, `handler_error`, through two small tables: plain LMI answers a bad request or
a failed generation with `{"error", "code"}` and 424 (DJL's handler failure), tgi_compat with TGI's
`{"error", "error_type"}` and 422 / 424 / 429. A kind a table does not answer propagates, and the
route renders it with LMI's ERROR_TABLE (Overloaded 503, Timeout 504, ClientGone 499), as DJL's
front end answers those before any handler runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from lmi_serve.dialects.common import guided
from lmi_serve.dialects.common import streaming
from lmi_serve.dialects.common.disconnect import ClientConnection, wait_for_results
from lmi_serve.dialects.common.ranking import best_first, rank_with_seeds
from lmi_serve.dialects.common.schema import parse_rolling_request, to_generation_requests
from lmi_serve.dialects.lmi import multi_record
from lmi_serve.dialects.lmi.errors import ERROR_TABLE
from lmi_serve.dialects.lmi.formatters import OutputFormatter, RenderContext, choose_formatter
from lmi_serve.dialects.lmi.hooks import apply_input_formatter, custom_formatter
from lmi_serve.dialects.openai.schema import ChatCompletionRequest
from lmi_serve.dialects.openai.schema import parse as parse_openai
from lmi_serve.dialects.openai.reasoning import ReasoningSettings
from lmi_serve.dialects.openai.service import OpenAIService
from lmi_serve.engine.engine import Engine
from lmi_serve.engine.generation import Generation
from lmi_serve.engine.types import GenerationRequest, GenerationResult
from lmi_serve.errors import GenerationFailed, InvalidRequest, Overloaded, ServingError, lookup
from lmi_serve.handler_api import Input, Output
from lmi_serve.handler_utils import read_payload

# kind -> the status of plain LMI's `{"error", "code"}` answer; None: the kind propagates.
LMI_HANDLER_ERRORS: dict[type[ServingError], int | None] = {
    InvalidRequest: 424,
    GenerationFailed: 424,
    ServingError: None,
}

# kind -> (status, TGI error_type, TGI's own wording or None for the kind's message); None: propagates.
TGI_COMPAT_HANDLER_ERRORS: dict[type[ServingError], tuple[int, str, str | None] | None] = {
    InvalidRequest: (422, "validation", None),
    GenerationFailed: (424, "generation", None),
    Overloaded: (429, "overloaded", "Model is overloaded"),
    ServingError: None,
}


def handler_error(error: ServingError, *, tgi_compat: bool) -> Output | None:
    """The handler's Output for `error` (see the module docstring), or None when the kind is the
    route's to render."""
    if tgi_compat:
        row = lookup(TGI_COMPAT_HANDLER_ERRORS, error)
        if row is None:
            return None
        status, error_type, wording = row
        body: dict[str, Any] = {"error": wording or error.message, "error_type": error_type}
    else:
        status = lookup(LMI_HANDLER_ERRORS, error)
        if status is None:
            return None
        body = {"error": error.message, "code": status}
    return Output(code=status, message="invoke handler failure").add(body)


def _any_failed(results: Sequence[GenerationResult]) -> bool:
    return any(r.finish_reason is not None and r.error for r in results)


class RollingBatchService:
    def __init__(self, engine: Engine, *, max_input_len: int, tgi_compat: bool = False,
                 output_formatter: str | None = None, custom_input: Callable | None = None,
                 custom_output: Callable | None = None, model_name: str = "model",
                 reasoning: ReasoningSettings | None = None, tool_call_parser: str | None = None, vision=None,
                 trust_request_template: bool = False):
        self.engine = engine
        self.trust_request_template = trust_request_template  # option.trust_request_chat_template, for `messages`
        self.vision = vision  # a vision-language model's processor (serving/vision.py), for chat image parts
        self.reasoning = reasoning
        self.model_name = model_name
        self.tool_call_parser = tool_call_parser
        self.max_input_len = max_input_len
        self.tgi_compat = tgi_compat
        self.output_formatter = output_formatter
        self.custom_input = custom_input
        self.custom_output = custom_output

    def inference(self, item: Input) -> Output:
        records = multi_record.split_records(item.get_as_bytes(), item.get_property("Content-Type"),
                                             sniff=self.custom_input is None)
        if records is not None:  # a Batch Transform mini-batch (multi_record.py)
            answerer = multi_record.RecordAnswerer(
                self._inference_one, lambda error: handler_error(error, tgi_compat=self.tgi_compat),
                lambda error: multi_record.route_error_body(ERROR_TABLE, error),
                workers=_rows(self.engine))
            return answerer.answer_all(item, records)
        return self._inference_one(item)

    def _inference_one(self, item: Input) -> Output:
        try:
            return self._answer(item)
        except ServingError as exc:
            output = handler_error(exc, tgi_compat=self.tgi_compat)
            if output is None:
                raise
            return output

    def _answer(self, item: Input) -> Output:
        payload = None if self.custom_input is not None else _read_payload(item)
        if isinstance(payload, dict) and "messages" in payload:
            return self._chat(item, payload)
        try:
            request = (apply_input_formatter(self.custom_input, item) if self.custom_input is not None
                       else parse_rolling_request({"inputs": payload} if isinstance(payload, str) else payload))
            custom = (custom_formatter(self.custom_output, stream=request.stream)
                      if self.custom_output is not None else None)
            formatter = choose_formatter(request.parameters.output_formatter, self.output_formatter,
                                         request.stream, self.tgi_compat, custom=custom)
            request = _with_header_adapter(request, item)
            prompt_ids = self.engine.tokenizer(request.inputs).input_ids
            requests = to_generation_requests(request.parameters, prompt_ids,
                                              eos_token_ids=self.engine.eos_token_ids,
                                              max_model_len=self.engine.max_model_len,
                                              max_input_len=self.max_input_len)
        except ServingError:
            raise
        except (ValueError, KeyError) as exc:  # what the tokenizer refuses, as the parsers' refusals
            raise InvalidRequest(str(exc)) from None
        ctx = RenderContext.for_request(request, tgi_compat=self.tgi_compat, seed=requests[0].sampling.seed,
                                        prompt_tokens_count=len(requests[0].prompt_ids))
        if request.parameters.num_beams > 1:
            return self._beams(ctx, formatter, requests[0], request.parameters)
        generation = guided.generate(self.engine, requests, "parameters.grammar")
        if formatter.streams(request.stream):
            return self._stream(ctx, formatter, generation)
        return self._whole(ctx, formatter, generation, request.parameters.n)

    def _chat(self, item: Input, payload: dict) -> Output:
        """LMI's chat schema: an OpenAI chat request; the same chat.completion object back, and a
        stream of chat.completion.chunk objects as JSON lines (SSE with [DONE] when the client
        accepts text/event-stream or option.output_formatter=sse)."""
        chat = OpenAIService(self.engine, self.model_name, reasoning=self.reasoning,
                             tool_call_parser=self.tool_call_parser, vision=self.vision,
                             trust_request_template=self.trust_request_template)
        reply = chat.chat(parse_openai(ChatCompletionRequest, payload))
        if reply.chunks is None:
            return Output().add(reply.body).add_property("Content-Type", "application/json")
        wants_sse = (streaming.SSE_MIMETYPE in (item.get_property("Accept") or "")
                     or self.output_formatter == "sse")
        if wants_sse:
            return Output().add_property("Content-Type", streaming.SSE_MIMETYPE).add_stream_content(
                streaming.sse(reply.chunks, done=True), output_formatter=lambda chunk: chunk)
        return Output().add_property("Content-Type", streaming.JSONLINES_MIMETYPE).add_stream_content(
            streaming.jsonlines(reply.chunks), output_formatter=lambda chunk: chunk)

    def _beams(self, ctx: RenderContext, formatter: OutputFormatter, request, parameters) -> Output:
        try:
            connection = ClientConnection.current()  # the search is dropped if the client goes away
            results = self.engine.beam_search(request, parameters.num_beams,
                                              connection.closed if connection is not None else None)
        except ServingError:
            raise
        except Exception as exc:  # a failed beam search fails this request only
            raise GenerationFailed(f"exception occurred during beam search: {exc}") from exc
        return self._render_whole(ctx, formatter, best_first(results, parameters.n), _any_failed(results))

    def _whole(self, ctx: RenderContext, formatter: OutputFormatter, generation: Generation, n: int) -> Output:
        results = wait_for_results(generation)  # cancelled if the client goes away meanwhile
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
        generation.start()  # a failure before any token raises its kind here: still a real status code
        output = Output().add_property("Content-Type", formatter.mimetype)
        return output.add_stream_content(_render_stream(ctx, formatter, generation),
                                         output_formatter=lambda chunk: chunk)


# SageMaker's per-request adapter header (inference components), which LMI reads when the body names none
ADAPTER_HEADER = "X-Amzn-SageMaker-Adapter-Identifier"


def _with_header_adapter(request, item: Input):
    """`request` with the adapter the header names, unless the body names one."""
    name = item.get_property(ADAPTER_HEADER)
    if not name or request.parameters.adapters is not None:
        return request
    return replace(request, parameters=request.parameters.model_copy(update={"adapters": name}))


def _rows(engine) -> int:
    """The rows the engine decodes together: threads beyond them would only wait in its queue."""
    scheduler = getattr(engine, "scheduler", None)
    return getattr(scheduler, "max_batch_size", None) or 8


def _read_payload(item: Input) -> Any:
    try:
        return read_payload(item)
    except ValueError as exc:  # a body that is not JSON, or text/plain that is not UTF-8
        raise InvalidRequest(str(exc)) from None


def _render_stream(ctx: RenderContext, formatter: OutputFormatter, generation: Generation) -> Iterator[str]:
    """Chunks for each event; closing this generator (client gone) cancels the engine request."""
    events = []
    for _, event in generation.events():
        events.append(event)
        yield formatter.render_chunk(ctx, events)
