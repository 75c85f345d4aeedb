"""What a handler module may declare, and what the server does with each declaration.

A handler module is a user's ``model.py`` (or ``option.entryPoint``) or a built-in handler in the
package's ``serving/handlers/`` folder. Only the entry point is required; everything else is optional
and unlocks a feature. The small Protocols below list every capability, grouped by who uses it:

==========================  ====================  ==================================================
capability                  Protocol              used by
==========================  ====================  ==================================================
``handle(inputs)``          `Handler`             every route (the name is ``option.handler``)
``load(config, context)``   `TypedLoad`           the service, for built-in handlers only
``SUPPORTS_ROLLING_BATCH``  `RollingBatch`        the service (``option.rolling_batch``)
``get_engine()``            `RollingBatch`        TGI, OpenAI, KServe/Triton generation, ``/models``
``get_vision()``            `RollingBatch`        OpenAI chat ``image_url`` parts (a VLM's processor)
``get_kernel_plan()``       (built-in handlers)   ``GET /models/<m>``: what runs the forward (kernels/plan.py)
``INPUT_TENSORS``           `TensorModel`         KServe v2 / Triton tensor routes, task inference
``OUTPUT_TENSORS``          `TensorModel`         KServe v2 / Triton tensor routes
``count_tokens(texts)``     `EmbeddingModel`      OpenAI ``/v1/embeddings`` (usage, limits)
``embedding_limits()``      `EmbeddingModel`      OpenAI ``/v1/embeddings`` (dimensions, limits)
``embedding_prompt(name)``  `EmbeddingModel`      OpenAI ``/v1/embeddings`` prompts, ``normalize``, ``dimensions``
``vocabulary_size()``       `TokenIdInputs`       OpenAI ``/v1/embeddings`` token-id inputs
``truncated_token_ids()``   `TokenIdInputs`       OpenAI ``/v1/embeddings`` ``truncate_prompt_tokens``
``classifier_head()``       `ClassifierModel`     ``/score``, ``/rerank``, ``/classify``, Triton infer
``count_tokens(rows)``      `ClassifierModel`     ``/score``, ``/rerank``, ``/classify`` (usage)
``@input_formatter``        (decorated function)  the built-in text handler's rolling batch
``@output_formatter``       (decorated function)  the built-in text handler's rolling batch
==========================  ====================  ==================================================

The formatter hooks are found by their decoration (``lmi_serve.input_formatter`` /
``output_formatter``), not by name, in a ``model.py`` that has no ``handle()`` and is therefore
served by the built-in handler.

All of it is read once, when the model loads, into a frozen `HandlerCapabilities`
(``ModelService.capabilities``); a declaration of the wrong kind (a tensor list without the other,
a ``count_tokens`` that is no function, ...) fails that model's load with a message naming the
module and the attribute. No other code looks attributes up on a handler module.

Built-in handlers are loaded from files like a user's ``model.py``, but receive the validated
`ModelConfig` typed through ``load(config, context)`` instead of DJL's first ``handle()`` call with
string properties. A user's ``model.py`` keeps DJL's contract; a ``load`` it defines is its own
business and never called by the server.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from lmi_serve.config.sources import ModelConfig, ServerConfig
from lmi_serve.handler_api import Input, Output, find_annotated
from lmi_serve.serving.handler_loader import HandlerLoadError

if TYPE_CHECKING:
    from lmi_serve.engine.engine import Engine
    from lmi_serve.serving.classification import ClassifierHead
    from lmi_serve.tensor_model import TensorSpec

__all__ = ["ClassifierModel", "EmbeddingModel",
           "Handler", "HandlerCapabilities", "HandlerContext", "HandlerDeclarationError",
           "RollingBatch", "TensorModel", "TokenIdInputs", "TypedLoad", "typed_from_properties"]


class HandlerDeclarationError(HandlerLoadError):
    """A handler module declares a capability in a shape the server cannot use; the model fails to load."""


@dataclass(frozen=True)
class HandlerContext:
    """What the server resolved for a built-in handler's `TypedLoad.load`, beside the ModelConfig."""

    task: str  # the served task (option.task, else inferred from the model files)
    cache_dir: str  # the server's cache folder (GGUF conversions, ...)
    rolling_batch: bool  # option.rolling_batch resolved: True serves requests on the shared Engine
    user_module: ModuleType | None = None  # the model.py the built-in serves (it has no handle())
    input_formatter: Callable[..., Any] | None = None  # its @input_formatter, if any
    output_formatter: Callable[..., Any] | None = None  # its @output_formatter, if any


# --- the capabilities, one small Protocol per consumer ------------------------------------------

class Handler(Protocol):
    """Required of every handler module."""

    def handle(self, inputs: Input) -> Output | None:
        """DJL's entry point, named by ``option.handler`` (default ``handle``); a built-in's is ``handle``.

        Requests (batches of them with ``batch_size > 1``) reach it from every route; it returns an
        Output. For a user's model.py the first call carries the model's options as string
        properties (``ModelConfig.handler_properties()`` plus ``task``, ``cache_dir``,
        ``model_name``, ``rolling_batch``) and no content; an Output with code >= 400 fails the
        load. A user module without it falls back to the built-in handler of the task."""


class TypedLoad(Protocol):
    """Built-in handlers only: the typed replacement of DJL's first ``handle()`` call."""

    def load(self, config: ModelConfig, context: HandlerContext) -> None:
        """Load the model from the validated config; raising fails the model's load. The server
        calls it once, before any request, instead of the string-properties first call."""


class RollingBatch(Protocol):
    """A handler that can serve requests on the rolling batch (continuous batching)."""

    SUPPORTS_ROLLING_BATCH: bool
    """True: ``handle`` is thread-safe and may be called per request, so ``option.rolling_batch``
    ``auto`` resolves to the rolling batch for text generation (``scheduler`` demands it). Without
    it the handler receives dynamic batches."""

    def get_engine(self) -> Engine | None:
        """The rolling-batch Engine once loaded (None in dynamic-batch mode), read once after the
        load as ``ModelService.engine``: the TGI, OpenAI generation and KServe/Triton LLM routes
        talk to it directly, and ``/models`` shows its stats."""

    def get_vision(self) -> Any:
        """A vision-language model's serving/vision.VisionInputs (its processor and image limit), read
        once with the engine as ``ModelService.vision``; None (or undeclared) for a text model, whose
        chat image parts are then a 400."""


class TensorModel(Protocol):
    """A model.py serving tensors on the KServe v2 / Triton routes (see tensor_model.py)."""

    INPUT_TENSORS: Sequence[TensorSpec]
    """The request tensors (names, datatypes, shapes): Triton's model metadata/config show them and
    every request is checked against them before ``handle`` runs. Without ``option.task`` their
    presence makes the model's task ``tensor``. Declared together with OUTPUT_TENSORS."""

    OUTPUT_TENSORS: Sequence[TensorSpec]
    """The tensors ``handle`` returns; every response is checked against them. Declared together
    with INPUT_TENSORS."""


class EmbeddingModel(Protocol):
    """A text-embedding handler that OpenAI's ``/v1/embeddings`` can serve (it needs both)."""

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Each text's token count, special tokens included: the response's ``usage`` and the
        per-input limit check."""

    def embedding_limits(self) -> tuple[int, int]:
        """(vector dimension, most tokens one input may have): checks ``dimensions`` and refuses
        over-long inputs with ``context_length_exceeded``."""

    def embedding_prompt(self, name: str | None) -> tuple[str, bool]:
        """Optional: (the text of the model's prompt `name`, or of its default prompt for None; whether
        pooling reads the prompt's tokens); a ValueError for an unknown name. Declaring it says that
        ``handle`` takes ``prompt`` (a text put before each text input), ``normalize`` and
        ``dimensions`` (Matryoshka truncation) beside ``inputs``: ``/v1/embeddings`` then honours
        ``prompt_name``, ``normalize`` and ``dimensions`` below the model's width."""


class TokenIdInputs(Protocol):
    """An embedding handler that accepts token-id lists in ``inputs``, embedded as given."""

    def vocabulary_size(self) -> int:
        """Token ids the model reads (0 <= id < size). Its presence lets ``/v1/embeddings`` take
        token-id inputs, checked against it."""

    def truncated_token_ids(self, texts: list[str], keep: int, side: str) -> list[list[int]]:
        """Optional: each text's token ids cut to at most `keep` tokens as the tokenizer truncates
        (special tokens kept; of the rest the last ones for side ``left``, the first for ``right``).
        ``/v1/embeddings`` embeds them as token-id inputs to honour vLLM's
        ``truncate_prompt_tokens`` on texts; without it a text longer than that is refused."""


class ClassifierModel(Protocol):
    """A text-classification handler (a reranker or classifier) the vLLM scoring routes and Triton serve.
    Its ``handle`` takes ``{"inputs": [text | {"text", "text_pair"}], "parameters": {"function_to_apply":
    "none", "return_all_scores": true}}`` and answers every label's logit per input, in label order."""

    def classifier_head(self) -> ClassifierHead:
        """The labels and the activation each API applies (serving/classification.py)."""

    def count_tokens(self, rows: list[tuple[str, str | None]]) -> list[int]:
        """Tokens the model reads per (text, text_pair or None): the responses' ``usage``."""


# --- reading them once ---------------------------------------------------------------------------

@dataclass(frozen=True)
class HandlerCapabilities:
    """What one handler module declares, read and checked once at load time (`read`)."""

    module_name: str
    handle: Callable[[Input], Output | None]
    builtin: bool = False
    load: Callable[[ModelConfig, HandlerContext], None] | None = None
    supports_rolling_batch: bool = False
    get_engine: Callable[[], Engine | None] | None = None
    get_vision: Callable[[], Any] | None = None
    get_kernel_plan: Callable[[], Any] | None = None
    input_tensors: tuple[TensorSpec, ...] | None = None
    output_tensors: tuple[TensorSpec, ...] | None = None
    count_tokens: Callable[[list[str]], list[int]] | None = None
    embedding_limits: Callable[[], tuple[int, int]] | None = None
    embedding_prompt: Callable[[str | None], tuple[str, bool]] | None = None
    vocabulary_size: Callable[[], int] | None = None
    truncated_token_ids: Callable[[list[str], int, str], list[list[int]]] | None = None
    classifier_head: Callable[[], ClassifierHead] | None = None
    input_formatter: Callable[..., Any] | None = None
    output_formatter: Callable[..., Any] | None = None

    @property
    def serves_tensors(self) -> bool:
        """Declares INPUT_TENSORS and OUTPUT_TENSORS (`read` allows both or neither)."""
        return self.input_tensors is not None

    @classmethod
    def read(cls, module: ModuleType, function_name: str = "handle", *, builtin: bool = False,
             user_module: ModuleType | None = None) -> HandlerCapabilities:
        """Read every capability `module` declares; raise HandlerDeclarationError for one it
        declares wrongly. `builtin`: a handler from ``serving/handlers/`` (only those get `TypedLoad`);
        `user_module`: the model.py such a built-in serves, whose formatter hooks apply. An
        attribute set to None counts as not declared."""
        where = _where(module)
        handle = _function(module, function_name, where)
        if handle is None:
            raise HandlerDeclarationError(f"{where} defines no {function_name}() (option.handler)")
        rolling = getattr(module, "SUPPORTS_ROLLING_BATCH", None)
        if rolling is not None and not isinstance(rolling, bool):
            raise HandlerDeclarationError(f"{where}: SUPPORTS_ROLLING_BATCH must be True or False, "
                                          f"not {rolling!r}")
        inputs, outputs = _tensors(module, where)
        return cls(
            module_name=module.__name__, handle=handle, builtin=builtin,
            load=_function(module, "load", where) if builtin else None,
            supports_rolling_batch=bool(rolling), get_engine=_function(module, "get_engine", where),
            get_vision=_function(module, "get_vision", where),
            get_kernel_plan=_function(module, "get_kernel_plan", where),
            input_tensors=inputs, output_tensors=outputs,
            count_tokens=_function(module, "count_tokens", where),
            embedding_limits=_function(module, "embedding_limits", where),
            embedding_prompt=_function(module, "embedding_prompt", where),
            vocabulary_size=_function(module, "vocabulary_size", where),
            truncated_token_ids=_function(module, "truncated_token_ids", where),
            classifier_head=_function(module, "classifier_head", where),
            input_formatter=find_annotated(user_module, "is_input_formatter") if user_module else None,
            output_formatter=find_annotated(user_module, "is_output_formatter") if user_module else None)


def _where(module: ModuleType) -> str:
    path = getattr(module, "__file__", None)
    return f"handler module {module.__name__}" + (f" ({path})" if path else "")


def _function(module: ModuleType, name: str, where: str) -> Callable[..., Any] | None:
    value = getattr(module, name, None)
    if value is not None and (not callable(value) or isinstance(value, type)):
        raise HandlerDeclarationError(f"{where}: {name} must be a function, not {type(value).__name__} {value!r}")
    return value


def _tensors(module: ModuleType, where: str) -> tuple[tuple[TensorSpec, ...] | None, tuple[TensorSpec, ...] | None]:
    declared = {name: getattr(module, name, None) for name in ("INPUT_TENSORS", "OUTPUT_TENSORS")}
    missing = [name for name, value in declared.items() if value is None]
    if len(missing) == 2:
        return None, None
    if missing:
        given = next(name for name in declared if name not in missing)
        raise HandlerDeclarationError(f"{where} declares {given} but not {missing[0]}; a tensor model "
                                      "declares both")
    from lmi_serve.tensor_model import TensorSpec

    checked = []
    for name, value in declared.items():
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
            raise HandlerDeclarationError(f"{where}: {name} must be a non-empty list of TensorSpec, not {value!r}")
        wrong = next((spec for spec in value if not isinstance(spec, TensorSpec)), None)
        if wrong is not None:
            raise HandlerDeclarationError(f"{where}: {name} holds {wrong!r}, which is no TensorSpec")
        names = [spec.name for spec in value]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise HandlerDeclarationError(f"{where}: {name} declares {', '.join(twice)} more than once")
        checked.append(tuple(value))
    return checked[0], checked[1]


def typed_from_properties(props: Mapping[str, str], task: str) -> tuple[ModelConfig, HandlerContext]:
    """A built-in's `TypedLoad.load` arguments from DJL's first-call string properties, for a
    built-in reached through ``handle()`` (a user's model.py delegating to it, or a test driving
    DJL's contract). The values are validated by ModelConfig, with its defaults; ``rolling_batch``
    is the resolved ``scheduler`` or anything else, as the server sends it."""
    config = ModelConfig.from_handler_properties(props)
    cache_dir = props.get("cache_dir") or ServerConfig.model_fields["cache_dir"].get_default(call_default_factory=True)
    return config, HandlerContext(task=config.task or task, cache_dir=cache_dir,
                                  rolling_batch=config.rolling_batch == "scheduler")
