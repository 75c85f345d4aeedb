"""Run one validated request on a model and get its response tensors back.

The LLM goes straight to the engine (neutral GenerationRequest in, TokenEvents out); the embedding
model and custom tensor models go through their handler's job queue as DJL Inputs, like
/invocations does. Failures are the core's kinds, answered by Triton's one table (protocol.py):
InvalidRequest (400) for the client's mistakes, Overloaded / Timeout / NotReady (503) when the
model cannot take the request now, GenerationFailed (500) when the model itself failed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from lmi_serve.serving.classifier_call import logits_request, read_logits
from lmi_serve.dialects.common.disconnect import wait_for_results
from lmi_serve.dialects.triton.llm import LlmCall, llm_outputs, parse_llm_call
from lmi_serve.dialects.triton.models import ModelContract
from lmi_serve.engine.engine import Engine
from lmi_serve.engine.generation import Generation
from lmi_serve.engine.types import GenerationResult
from lmi_serve.errors import GenerationFailed, InvalidRequest
from lmi_serve.handler_api import Input, Output, PairList
from lmi_serve.serving.classification import activate
from lmi_serve.serving.service import ModelService
from lmi_serve.tensor_model import read_output_tensors, tensor_input
from lmi_serve.tensors import WireTensor, as_wire_tensor


HANDLER_FAILURE = 424  # DJL's status for an exception in handle(): the model failed, not the client


@dataclass
class ModelCall:
    """A request that passed validation: what every runner needs."""

    service: ModelService
    contract: ModelContract
    tensors: dict[str, WireTensor]
    parameters: dict[str, Any]
    request_id: str
    requested_outputs: list[str] | None  # None: the model's default outputs


def _submit(engine: Engine, call: LlmCall) -> Generation:
    return engine.generate([call.request])  # Overloaded: Triton's table answers 503


class ModelStream:
    """generate_stream's responses, validated and submitted but not read yet.

    `start()` waits for the model's first event: a failure before any token (a queue timeout, a
    failed prefill) raises its kind there, before the route commits to a status line. Iterating
    yields one response (a list of tensors) at a time; `close()` (the client went away, or the
    response is done) cancels the generation, even one whose responses were never read.
    """

    def __init__(self, responses: Iterator[list[WireTensor]], generation: Generation | None = None):
        self._responses, self._generation = responses, generation

    def start(self) -> None:
        if self._generation is not None:
            self._generation.start()

    def __iter__(self) -> Iterator[list[WireTensor]]:
        return self

    def __next__(self) -> list[WireTensor]:
        return next(self._responses)

    def close(self) -> None:
        close = getattr(self._responses, "close", None)
        if close is not None:
            close()
        if self._generation is not None:
            self._generation.close()  # a generator never started runs no finally of its own


def _llm_call(call: ModelCall) -> tuple[Engine, LlmCall]:
    engine = call.service.engine
    return engine, parse_llm_call(engine, call.tensors, call.parameters, call.requested_outputs)


def _run_llm(call: ModelCall) -> list[WireTensor]:
    return _complete(*_llm_call(call))


def _complete(engine: Engine, llm: LlmCall) -> list[WireTensor]:
    """The whole generation as one response (/infer, /generate, and generate_stream without `stream`)."""
    (result,) = wait_for_results(_submit(engine, llm))  # cancelled if the client goes away meanwhile
    if result.error:
        result.events[-1].raise_failure()  # a failure after some tokens: its kind (GenerationFailed, 500)
    return llm_outputs(llm, result.text, result, final=True, prepend_prompt=not llm.exclude_input)


def stream_llm(call: ModelCall) -> ModelStream:
    """Validate and submit now (errors raise before any response), then one response per released
    piece of text (see ModelStream for `start()` and cancelling)."""
    engine, llm = _llm_call(call)
    if not llm.stream:
        return ModelStream(iter([_complete(engine, llm)]))
    if not llm.exclude_input:
        raise InvalidRequest("When streaming, `exclude_input_in_output` = False is not allowed.")
    generation = _submit(engine, llm)
    return ModelStream(_llm_responses(llm, generation), generation)


def _llm_responses(llm: LlmCall, generation: Generation) -> Iterator[list[WireTensor]]:
    """Closing it (the client went away) cancels the generation."""
    result = GenerationResult(len(llm.request.prompt_ids))
    for _, event in generation.events():
        result.events.append(event)
        if event.error:
            event.raise_failure()  # a queue timeout is 503, a failed model 500: Triton's table
        final = event.finish_reason is not None
        if event.text or final:  # skip tokens whose text is still held back
            yield llm_outputs(llm, event.text, result, final=final, prepend_prompt=False)


def _handler_output(service: ModelService, request: Input) -> Output:
    # A full queue, a timeout or a model not ready raise their kinds: Triton's table answers 503.
    output = service.dispatcher.wait(service.submit(request))
    if output.code != 200:
        try:
            message = json.loads(output.body()).get("error") or output.message
        except (ValueError, AttributeError):
            message = output.message
        if 400 <= output.code < 500 and output.code != HANDLER_FAILURE:  # the handler refused the request
            raise InvalidRequest(str(message))
        raise GenerationFailed(f"model '{service.name}' failed: {message}")
    return output


def _texts(tensor: WireTensor) -> list[str]:
    try:
        return [value.decode("utf-8") for value in tensor.array.reshape(-1)]
    except UnicodeDecodeError:
        raise InvalidRequest(f"input '{tensor.name}' must be UTF-8 text") from None


def _run_embedding(call: ModelCall) -> list[WireTensor]:
    texts = _texts(call.tensors["text_input"])
    if not texts:
        raise InvalidRequest("input 'text_input' must hold at least one text")
    body = json.dumps({"inputs": texts}).encode("utf-8")
    request = Input({"Content-Type": "application/json", "requestId": call.request_id}, PairList([("data", body)]))
    vectors = json.loads(_handler_output(call.service, request).body())
    return [as_wire_tensor("embedding", "FP32", np.asarray(vectors, dtype=np.float32).reshape(len(texts), -1))]


def _run_classifier(call: ModelCall) -> list[WireTensor]:
    texts = _texts(call.tensors["text_input"])
    pairs = _texts(call.tensors["text_pair"]) if "text_pair" in call.tensors else [None] * len(texts)
    if not texts:
        raise InvalidRequest("input 'text_input' must hold at least one text")
    if len(pairs) != len(texts):
        raise InvalidRequest(f"input 'text_pair' holds {len(pairs)} texts and 'text_input' {len(texts)}: "
                             "one pair per text")
    rows = list(zip(texts, pairs))
    output = _handler_output(call.service, logits_request(rows, call.request_id))
    try:
        logits = read_logits(output.body(), len(rows))
    except (ValueError, KeyError, TypeError) as exc:
        raise GenerationFailed(f"model '{call.service.name}' answered an unexpected shape: {exc}") from None
    function = call.service.capabilities.classifier_head().score_activation
    scores = [activate(row, function) for row in logits]
    return [as_wire_tensor("logits", "FP32", np.asarray(logits, dtype=np.float32).reshape(len(rows), -1)),
            as_wire_tensor("scores", "FP32", np.asarray(scores, dtype=np.float32).reshape(len(rows), -1))]


def _run_tensor_model(call: ModelCall) -> list[WireTensor]:
    # Request parameters reach handle() as properties, the way DJL hands it request headers.
    properties = {key: json.dumps(value) if isinstance(value, bool) else str(value)
                  for key, value in call.parameters.items()}
    properties["requestId"] = call.request_id
    output = _handler_output(call.service, tensor_input(list(call.tensors.values()), properties))
    try:
        return read_output_tensors(output, list(call.contract.outputs), call.service.name)
    except (ValueError, KeyError) as exc:  # handle() returned tensors it does not declare: the model failed
        raise GenerationFailed(str(exc)) from None


_RUNNERS = {"llm": _run_llm, "embedding": _run_embedding, "classifier": _run_classifier,
            "tensor": _run_tensor_model}


def run_model(call: ModelCall) -> list[WireTensor]:
    """One response: the model's outputs in the order it produced them, narrowed to those asked for."""
    outputs = _RUNNERS[call.contract.kind](call)
    if call.requested_outputs is not None:
        outputs = [tensor for tensor in outputs if tensor.name in call.requested_outputs]
    return outputs


def stream_model(call: ModelCall) -> ModelStream:
    """Responses for generate_stream: token deltas from the LLM when `stream` is set, else one."""
    if call.contract.kind == "llm":
        return stream_llm(call)
    return ModelStream(iter([run_model(call)]))
