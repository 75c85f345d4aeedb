"""The seam between the built-in text-generation handler (handlers/huggingface.py) and the dialect
that answers its requests, so that serving imports no dialect (a layer imports only the layers below
it: tests/unit/repo/test_import_cycles.py).

The handler loads the model and builds the engine; what a request body means and how its answer
looks is LMI's (DJL's huggingface handler contract). So the LMI dialect builds the `FrontEnd` that
turns the handler's `Input` into its `Output` (dialects/lmi/front_end.py `lmi_front_end`: the
rolling-batch service, or the dynamic batch's parser and renderer), from a `TextModel`: what the
handler loaded. The server installs that builder when it builds a worker's app (server/app.py),
before any model loads; so does the test suite (tests/conftest.py). A handler that finds none
installed fails its load, saying so.

    install(lmi_front_end)                         # once per process, by the composition root
    front_end = build_front_end(TextModel(...))    # by the handler, once its model is loaded
    output = front_end.inference(inputs)           # per request (or per dynamic batch)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from lmi_serve.handler_api import Input, Output

if TYPE_CHECKING:  # torch and pydantic: the annotations only
    from lmi_serve.config.sources import ModelConfig
    from lmi_serve.engine.engine import Engine
    from lmi_serve.engine.types import GenerationRequest, TokenEvent
    from lmi_serve.serving.vision import VisionInputs


@dataclass(frozen=True)
class TextModel:
    """What the built-in text handler loaded, for the front end that answers its requests."""

    config: ModelConfig
    tokenizer: Any
    max_input_len: int  # option.max_input_len, else what the context leaves of one token
    max_model_len: int
    eos_token_ids: frozenset[int]
    # The rolling batch's engine; None: dynamic batching, where `generate` runs one static batch and
    # yields (request index, event) as the rows advance.
    engine: Engine | None
    generate: Callable[[list[GenerationRequest]], Iterator[tuple[int, TokenEvent]]]
    vision: VisionInputs | None = None  # a vision-language model's processor, for chat image parts
    input_formatter: Callable[..., Any] | None = None  # a model.py's @input_formatter (HandlerContext)
    output_formatter: Callable[..., Any] | None = None  # its @output_formatter


class FrontEnd(Protocol):
    """Answers the handler's requests: one Input (a dynamic batch of them with batch_size > 1)."""

    def inference(self, inputs: Input) -> Output: ...


FrontEndBuilder = Callable[[TextModel], FrontEnd]

_builder: FrontEndBuilder | None = None


def install(builder: FrontEndBuilder) -> None:
    """Make `builder` the one that answers the built-in text handler's requests in this process."""
    global _builder
    _builder = builder


def build_front_end(model: TextModel) -> FrontEnd:
    """The installed builder's front end for `model`."""
    if _builder is None:
        raise RuntimeError("No front end answers the built-in text-generation handler's requests in this "
                           "process: the server installs the LMI dialect's when it builds its app "
                           "(serving.front_end.install(dialects.lmi.front_end.lmi_front_end)); a program "
                           "that loads models without the server must install it too")
    return _builder(model)
