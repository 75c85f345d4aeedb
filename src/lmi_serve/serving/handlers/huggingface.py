"""Built-in text-generation handler: `load(config, context)`, then `handle(inputs) -> Output`.

The server calls `load` with the validated ModelConfig (handler_protocol.py); a model.py that
delegates to this handler through DJL's contract reaches it by a first `handle()` call with string
properties instead, validated back into a ModelConfig. Two modes, chosen once at start-up
(`context.rolling_batch`, which the server resolves):
- rolling batch: each request goes to the shared Engine (continuous batching); this handler is then
  called on request threads.
- dynamic batch: the requests of a batch are generated together in one batched forward per step.
What a request body means and how its answer looks is the LMI dialect's: it builds the front end
that answers `handle` from what this handler loaded (serving/front_end.py, dialects/lmi/front_end.py).
"""

from __future__ import annotations

import logging

import torch

from lmi_serve.config.sources import ModelConfig, tensor_parallel_conflict
from lmi_serve.engine.build import build_engine, prepare_serving
from lmi_serve.engine.engine import Engine
from lmi_serve.engine.static_batch import eos_token_ids, generate_static_batch
from lmi_serve.engine.types import GenerationRequest, StopParams
from lmi_serve.handler_api import Input, Output
from lmi_serve.model.chat_template import override_chat_template
from lmi_serve.model.loader import four_bit_source, load_generation_model
from lmi_serve.kernels.host import probe
from lmi_serve.kernels.plan import KernelPlan, plan_kernels
from lmi_serve.model.tp import TPGroup, resolve_degree, start_group
from lmi_serve.serving.front_end import FrontEnd, TextModel, build_front_end
from lmi_serve.serving.handler_protocol import HandlerContext, typed_from_properties
from lmi_serve.serving.vision import FetchPolicy, VisionInputs

log = logging.getLogger(__name__)


def _plan(model, config: ModelConfig, device, source: str, sharded: bool) -> KernelPlan:
    """The kernels' swaps in their order (kernels/plan.py), logged once; option.quantize=q4 reads the 4-bit
    weights the model came from (`source`: the folder it loaded). A sharded layer keeps torch's kernel: its
    forward carries the tensor-parallel communication."""
    q4_source = None
    if config.quantize == "q4":
        q4_source = four_bit_source(config.model_id or config.model_dir, config.gguf_file, source)
    plan = plan_kernels(model, config, probe(), device=device, q4_source=q4_source, sharded=sharded)
    log.info("%s", plan.summary())
    return plan


def _tensor_parallel(config: ModelConfig, context: HandlerContext) -> TPGroup | None:
    """With tensor_parallel_degree > 1 (model/tp.py): start the other ranks and join their group as rank 0."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    degree = resolve_degree(config.tensor_parallel_degree, gpus)
    if degree <= 1:
        return None
    conflict = tensor_parallel_conflict(config, degree)
    if conflict or not context.rolling_batch:
        raise ValueError(conflict or f"tensor_parallel_degree={degree} needs the rolling batch, and this model is "
                         "served with dynamic batching")
    group, _ = start_group(config.model_dump_json(), context.cache_dir, degree)
    return group


class TextGenerationService:
    def __init__(self, config: ModelConfig, context: HandlerContext):
        self.tp_group = _tensor_parallel(config, context)
        try:
            self._load(config, context)
        except BaseException:
            if self.tp_group is not None:
                self.tp_group.stop()
            raise

    def _load(self, config: ModelConfig, context: HandlerContext) -> None:
        loaded = load_generation_model(
            config.model_id or config.model_dir, gguf_file=config.gguf_file, dtype=config.dtype,
            device_map=config.device_map, tensor_parallel_degree=config.tensor_parallel_degree,
            revision=config.revision, trust_remote_code=config.trust_remote_code, cache_dir=context.cache_dir)
        self.model, self.tokenizer, self.device = loaded.model, loaded.tokenizer, loaded.device
        # A vision-language model (model/task.py VISION_ARCHITECTURES): its processor turns chat images into tensors.
        processor = getattr(loaded, "processor", None)  # a loader of another shape (tests' fakes) has none
        # Before anything reads the template (tool format, reasoning markers, the engine's services).
        override_chat_template(self.tokenizer, processor, config.chat_template)
        self.vision = (VisionInputs(processor, config.limit_mm_per_prompt,
                                    FetchPolicy(config.image_fetch, config.image_fetch_timeout))
                       if processor is not None else None)
        self.kernels = _plan(self.model, config, self.device, loaded.source, sharded=self.tp_group is not None)
        # After the swaps above (LoRA wraps the layers as they will run) and before the warm-up: the
        # support check, LoRA, the context limit, the KV layout, tensor parallelism (engine/build.py).
        serving = prepare_serving(self.model, self.device, config, rolling=context.rolling_batch,
                                  tp_group=self.tp_group)
        self.kv_layout, self.max_model_len = serving.kv_layout, serving.max_model_len
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        self.max_input_len = config.max_input_len or self.max_model_len - 1
        self.streaming = config.enable_streaming
        self._warm_up()
        self.engine: Engine | None = None
        if context.rolling_batch:
            self.engine = build_engine(self.model, self.tokenizer, self.device, config, serving,
                                       tp_group=self.tp_group).start()
        self.front_end: FrontEnd = build_front_end(TextModel(
            config, self.tokenizer, max_input_len=self.max_input_len, max_model_len=self.max_model_len,
            eos_token_ids=self.eos_ids, engine=self.engine, generate=self._generate, vision=self.vision,
            input_formatter=context.input_formatter, output_formatter=context.output_formatter))

    def _warm_up(self) -> None:
        """One tiny generation so the first user request does not pay for lazy kernel setup."""
        request = GenerationRequest(tuple(self.tokenizer("Hello").input_ids), stop=StopParams(max_new_tokens=2))
        for _ in self._generate([request]):
            pass

    def _generate(self, requests: list[GenerationRequest]):
        """One static batch of `requests` (the dynamic-batch path): (request index, event) as rows advance."""
        return generate_static_batch(self.model, self.tokenizer, self.device, requests, self.kv_layout)

    def inference(self, inputs: Input) -> Output:
        return self.front_end.inference(inputs)


SUPPORTS_ROLLING_BATCH = True  # thread-safe in rolling mode: the server calls it per request
_service: TextGenerationService | None = None


def load(config: ModelConfig, context: HandlerContext) -> None:
    """The server's typed first call (handler_protocol.TypedLoad): load the model once."""
    global _service
    _service = TextGenerationService(config, context)


def get_engine() -> Engine | None:
    """The rolling-batch engine, for dialects (TGI, OpenAI, KServe) that talk to it directly."""
    return _service.engine if _service else None


def get_kernel_plan() -> KernelPlan | None:
    """What runs the model's forward on this host (kernels/plan.py), for GET /models/<m>."""
    return _service.kernels if _service else None


def get_vision() -> VisionInputs | None:
    """A vision-language model's processor and image limit, for chat image parts; None for a text model."""
    return _service.vision if _service else None


def handle(inputs: Input) -> Output | None:
    """Requests; before `load`, DJL's first call (no content, the options as string properties)."""
    if _service is None:
        load(*typed_from_properties(inputs.get_properties(), "text-generation"))
        return None
    if inputs.is_empty():
        return None
    return _service.inference(inputs)
