"""LMI's answers to the built-in text-generation handler's requests (serving/front_end.py): the dialect
asks the handler for what it loaded (a `TextModel`) and builds what parses the handler's `Input` and
renders its `Output`, chosen once per model:
- rolling batch: `RollingBatchService` (rolling.py) on the model's engine, with the model.py's
  formatter hooks;
- dynamic batch: `DynamicBatchService` (here): every request of a batch is parsed on its own, so a
  bad request fails alone (424) while the others are generated together in one static batch.

The server installs `lmi_front_end` (server/app.py); the handler builds it once its model is loaded.
"""

from __future__ import annotations

from collections.abc import Iterator

from lmi_serve.dialects.common.schema import DynamicBatchRequest, LmiRequestError, parse_dynamic_batch_request
from lmi_serve.dialects.lmi import rolling
from lmi_serve.dialects.openai.reasoning import reasoning_settings
from lmi_serve.engine.types import GenerationRequest, GenerationResult, StopParams
from lmi_serve.handler_api import Input, Output
from lmi_serve.handler_utils import parse_batch, read_payload
from lmi_serve.serving.front_end import FrontEnd, TextModel


def lmi_front_end(model: TextModel) -> FrontEnd:
    """The rolling-batch service on `model.engine`, or without one the dynamic batch's."""
    if model.engine is None:
        return DynamicBatchService(model)
    config = model.config
    # A model.py without handle() may still bring formatter hooks (its @input_formatter / @output_formatter).
    return rolling.RollingBatchService(
        model.engine, max_input_len=model.max_input_len, tgi_compat=config.tgi_compat,
        output_formatter=config.output_formatter,
        custom_input=model.input_formatter,
        custom_output=model.output_formatter,
        model_name=config.name, reasoning=reasoning_settings(config),
        tool_call_parser=config.tool_call_parser, vision=model.vision,
        trust_request_template=config.trust_request_chat_template)


class DynamicBatchService:
    """LMI's dynamic-batch schema on one static batch per call (option.rolling_batch=disable)."""

    def __init__(self, model: TextModel):
        self.model = model
        self.streaming = model.config.enable_streaming

    def _to_generation_requests(self, parsed: DynamicBatchRequest) -> list[GenerationRequest]:
        model, params = self.model, parsed.parameters
        requests = []
        for prompt in parsed.prompts:
            ids = tuple(model.tokenizer(prompt).input_ids)
            if len(ids) > model.max_input_len:
                raise LmiRequestError(f"Input has {len(ids)} tokens, over the limit of {model.max_input_len}")
            room = model.max_model_len - len(ids)
            stop = StopParams(max_new_tokens=min(params.max_new_tokens, room),
                              stop_sequences=tuple(params.stop_sequences or ()), eos_token_ids=model.eos_token_ids,
                              ignore_eos=params.ignore_eos_token)
            requests.append(GenerationRequest(ids, params.sampling(), stop))
        return requests

    def _parse(self, item: Input) -> tuple[DynamicBatchRequest, list[GenerationRequest]]:
        payload = read_payload(item)
        if isinstance(payload, dict) and "messages" in payload:
            raise LmiRequestError("Chat requests (`messages`) need the rolling batch; this model is served with "
                                  "dynamic batching (option.rolling_batch=disable)")
        parsed = parse_dynamic_batch_request(payload)
        return parsed, self._to_generation_requests(parsed)

    def _stream(self, requests: list[GenerationRequest]) -> Iterator[list[str]]:
        for _, event in self.model.generate(requests):
            if event.text:
                yield [event.text]

    def inference(self, inputs: Input) -> Output:
        output, parsed = parse_batch(inputs, self._parse)
        if self.streaming and not inputs.is_batch() and parsed:
            _, requests = parsed[0]
            return Output().add_property("Content-Type", "application/jsonlines").add_stream_content(
                self._stream(requests))
        flat = [(index, r) for index, (_, reqs) in parsed.items() for r in reqs]
        results = [GenerationResult(len(r.prompt_ids)) for _, r in flat]
        if flat:
            for row, event in self.model.generate([r for _, r in flat]):
                results[row].events.append(event)
        for index, (request, _) in parsed.items():
            texts = [res.text for (owner, _), res in zip(flat, results) if owner == index]
            if request.parameters.return_full_text:
                texts = [prompt + text for prompt, text in zip(request.prompts, texts)]
            body = [{"generated_text": text} for text in texts]
            output.add(body, batch_index=index if inputs.is_batch() else None)
        return output
