"""Built-in text-generation handler: `handle(inputs) -> Output`.

Two modes, chosen once at start-up (the `rolling_batch` property the server resolves):
- rolling batch: each request goes to the shared Engine (continuous batching) with the LMI
  rolling-batch schema and output formatters; this handler is then called on request threads.
- dynamic batch: every request of a batch is parsed on its own, so a bad request fails alone (424)
  while the others are generated together in one batched forward per step.
"""

from __future__ import annotations

import logging

from lmi_serve.dialects.lmi.rolling import RollingBatchService
from lmi_serve.dialects.lmi.schema import DynamicBatchRequest, LmiRequestError, parse_dynamic_batch_request
from lmi_serve.engine.engine import Engine
from lmi_serve.engine.static_batch import eos_token_ids, generate_static_batch
from lmi_serve.engine.types import GenerationRequest, GenerationResult, StopParams
from lmi_serve.handler_api import Input, Output, find_annotated
from lmi_serve.handler_utils import parse_batch, read_payload
from lmi_serve.model.loader import load_causal_lm

log = logging.getLogger(__name__)


def _flag(props: dict, key: str) -> bool:
    return str(props.get(key, "false")).lower() == "true"


def _optional_int(props: dict, key: str) -> int | None:
    value = props.get(key)
    return int(value) if value not in (None, "", "None") else None


class TextGenerationService:
    def __init__(self, props: dict[str, str]):
        loaded = load_causal_lm(
            props.get("model_id") or props["model_dir"], gguf_file=props.get("gguf_file") or None,
            dtype=props.get("dtype", "auto"), device_map=props.get("device_map") or None,
            tensor_parallel_degree=props.get("tensor_parallel_degree", "1"),
            revision=props.get("revision") or None, trust_remote_code=_flag(props, "trust_remote_code"),
            cache_dir=props.get("cache_dir", "~/.cache/lmi-serve"))
        self.model, self.tokenizer, self.device = loaded.model, loaded.tokenizer, loaded.device
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        context = getattr(self.model.config, "max_position_embeddings", None) or 2048
        self.max_model_len = min(_optional_int(props, "max_model_len") or context, context)
        self.max_input_len = _optional_int(props, "max_input_len") or self.max_model_len - 1
        self.streaming = _flag(props, "enable_streaming")
        self._warm_up()
        self.engine: Engine | None = None
        self.rolling: RollingBatchService | None = None
        if props.get("rolling_batch") == "scheduler":
            self.engine = Engine(self.model, self.tokenizer, self.device,
                                 max_batch_size=int(props.get("max_rolling_batch_size", 32)),
                                 max_queue=int(props.get("job_queue_size", 1000)),
                                 predict_timeout=float(props.get("predict_timeout", 120)),
                                 max_prefill_tokens=int(props.get("max_rolling_batch_prefill_tokens", 512)),
                                 max_model_len=self.max_model_len, name=props.get("model_name", "model")).start()
            user = USER_MODULE  # a model.py without handle() may still bring formatter hooks
            self.rolling = RollingBatchService(
                self.engine, max_input_len=self.max_input_len, tgi_compat=_flag(props, "tgi_compat"),
                output_formatter=props.get("output_formatter") or None,
                custom_input=find_annotated(user, "is_input_formatter") if user else None,
                custom_output=find_annotated(user, "is_output_formatter") if user else None,
                model_name=props.get("model_name", "model"))

    def _warm_up(self) -> None:
        """One tiny generation so the first user request does not pay for lazy kernel setup."""
        request = GenerationRequest(tuple(self.tokenizer("Hello").input_ids), stop=StopParams(max_new_tokens=2))
        for _ in generate_static_batch(self.model, self.tokenizer, self.device, [request]):
            pass

    def _to_generation_requests(self, parsed: DynamicBatchRequest) -> list[GenerationRequest]:
        params = parsed.parameters
        requests = []
        for prompt in parsed.prompts:
            ids = tuple(self.tokenizer(prompt).input_ids)
            if len(ids) > self.max_input_len:
                raise LmiRequestError(f"Input has {len(ids)} tokens, over the limit of {self.max_input_len}")
            room = self.max_model_len - len(ids)
            stop = StopParams(max_new_tokens=min(params.max_new_tokens, room),
                              stop_sequences=tuple(params.stop_sequences or ()), eos_token_ids=self.eos_ids,
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

    def _stream(self, requests: list[GenerationRequest]):
        for _, event in generate_static_batch(self.model, self.tokenizer, self.device, requests):
            if event.text:
                yield [event.text]

    def inference(self, inputs: Input) -> Output:
        if self.rolling is not None:
            return self.rolling.inference(inputs)
        output, parsed = parse_batch(inputs, self._parse)
        if self.streaming and not inputs.is_batch() and parsed:
            _, requests = parsed[0]
            return Output().add_property("Content-Type", "application/jsonlines").add_stream_content(
                self._stream(requests))
        flat = [(index, r) for index, (_, reqs) in parsed.items() for r in reqs]
        results = [GenerationResult(len(r.prompt_ids)) for _, r in flat]
        if flat:
            for row, event in generate_static_batch(self.model, self.tokenizer, self.device, [r for _, r in flat]):
                results[row].events.append(event)
        for index, (request, _) in parsed.items():
            texts = [res.text for (owner, _), res in zip(flat, results) if owner == index]
            if request.parameters.return_full_text:
                texts = [prompt + text for prompt, text in zip(request.prompts, texts)]
            body = [{"generated_text": text} for text in texts]
            output.add(body, batch_index=index if inputs.is_batch() else None)
        return output


SUPPORTS_ROLLING_BATCH = True  # thread-safe in rolling mode: the server calls it per request
USER_MODULE = None  # set by the handler loader when a model.py without handle() is served
_service: TextGenerationService | None = None


def get_engine() -> Engine | None:
    """The rolling-batch engine, for dialects (TGI, OpenAI, KServe) that talk to it directly."""
    return _service.engine if _service else None


def handle(inputs: Input) -> Output | None:
    """DJL contract: the first call (no content) carries the model options and loads the model."""
    global _service
    if _service is None:
        _service = TextGenerationService(inputs.get_properties())
        return None
    if inputs.is_empty():
        return None
    return _service.inference(inputs)
