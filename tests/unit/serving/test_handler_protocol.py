"""The handler protocol: what a handler module declares is read once (HandlerCapabilities.read) and
checked, and the built-in handlers receive the validated ModelConfig typed (load(config, context)),
while a user's model.py keeps DJL's first handle() call with string properties."""

from __future__ import annotations

import textwrap
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from lmi_serve.config.sources import ConfigError, ModelConfig, ServerConfig
from lmi_serve.engine.kv.dynamic import DYNAMIC
from lmi_serve.engine.kv.prefix_cache import PrefixCache
from lmi_serve.engine.kv.slots import SLOTS
from lmi_serve.engine.sampling.watermark import WatermarkSettings
from lmi_serve.engine.speculation import NgramSettings
from lmi_serve.dialects.openai.reasoning import ReasoningSettings
from lmi_serve.handler_api import Input, input_formatter, output_formatter
from lmi_serve.serving.handler_loader import HandlerLoadError, resolve_handler
from lmi_serve.serving.handler_protocol import (HandlerCapabilities, HandlerContext, HandlerDeclarationError,
                                        typed_from_properties)
from lmi_serve.serving.service import ModelService, ModelStatus
from lmi_serve.tensor_model import TensorSpec

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
SPECS_IN = [TensorSpec("INPUT0", "INT32", [-1, 16])]
SPECS_OUT = [TensorSpec("OUTPUT0", "INT32", [-1, 16])]


def handle(inputs):
    return None


def module(name="handler_under_test", **attributes) -> types.ModuleType:
    made = types.ModuleType(name)
    made.__dict__.update(attributes)
    return made


# --- reading capabilities -------------------------------------------------------------------------

def test_a_module_with_only_handle_declares_nothing_else():
    caps = HandlerCapabilities.read(module(handle=handle))
    assert caps.handle is handle and caps.module_name == "handler_under_test"
    assert not caps.builtin and not caps.supports_rolling_batch and not caps.serves_tensors
    assert all(getattr(caps, name) is None for name in (
        "load", "get_engine", "input_tensors", "output_tensors", "count_tokens", "embedding_limits",
        "vocabulary_size", "input_formatter", "output_formatter"))


def test_every_capability_is_read_from_a_built_in():
    def load(config, context): ...
    def get_engine(): ...
    def count_tokens(texts): ...
    def embedding_limits(): ...
    def vocabulary_size(): ...

    @input_formatter
    def parse(inputs, **kwargs): ...

    @output_formatter
    def render(output): ...

    builtin = module(handle=handle, load=load, SUPPORTS_ROLLING_BATCH=True, get_engine=get_engine,
                     INPUT_TENSORS=SPECS_IN, OUTPUT_TENSORS=SPECS_OUT, count_tokens=count_tokens,
                     embedding_limits=embedding_limits, vocabulary_size=vocabulary_size)
    user = module("user_model", parse=parse, render=render)
    caps = HandlerCapabilities.read(builtin, "handle", builtin=True, user_module=user)
    assert caps.builtin and caps.load is load and caps.supports_rolling_batch and caps.get_engine is get_engine
    assert caps.serves_tensors and caps.input_tensors == tuple(SPECS_IN) and caps.output_tensors == tuple(SPECS_OUT)
    assert isinstance(caps.input_tensors, tuple)  # a snapshot: the module's list can change, not the contract
    assert (caps.count_tokens, caps.embedding_limits, caps.vocabulary_size) == (
        count_tokens, embedding_limits, vocabulary_size)
    assert caps.input_formatter is parse and caps.output_formatter is render
    with pytest.raises(AttributeError):
        caps.supports_rolling_batch = False  # frozen


def test_the_entry_point_is_the_named_function():
    def predict(inputs): ...

    assert HandlerCapabilities.read(module(predict=predict), "predict").handle is predict
    with pytest.raises(HandlerDeclarationError, match=r"handler_under_test defines no predict\(\) \(option.handler\)"):
        HandlerCapabilities.read(module(handle=handle), "predict")


def test_a_user_modules_load_is_never_the_typed_load():
    def load(config, context):
        raise AssertionError("a model.py keeps DJL's contract")

    assert HandlerCapabilities.read(module(handle=handle, load=load)).load is None


def test_formatter_hooks_come_from_the_model_py_a_built_in_serves_only():
    @input_formatter
    def parse(inputs, **kwargs): ...

    caps = HandlerCapabilities.read(module(handle=handle, parse=parse), builtin=True)
    assert caps.input_formatter is None  # the built-in's own module brings no hooks
    assert HandlerCapabilities.read(module(handle=handle), builtin=True,
                                    user_module=module("user", parse=parse)).input_formatter is parse


def test_attributes_set_to_none_count_as_not_declared():
    caps = HandlerCapabilities.read(module(handle=handle, SUPPORTS_ROLLING_BATCH=None, get_engine=None,
                                           INPUT_TENSORS=None, OUTPUT_TENSORS=None, count_tokens=None))
    assert not caps.supports_rolling_batch and caps.get_engine is None and not caps.serves_tensors


@pytest.mark.parametrize("attributes, message", [
    ({"handle": None}, r"defines no handle\(\)"),
    ({"handle": "handle"}, "handle must be a function, not str"),
    ({"SUPPORTS_ROLLING_BATCH": "yes"}, "SUPPORTS_ROLLING_BATCH must be True or False, not 'yes'"),
    ({"SUPPORTS_ROLLING_BATCH": 1}, "SUPPORTS_ROLLING_BATCH must be True or False, not 1"),
    ({"get_engine": 42}, "get_engine must be a function, not int"),
    ({"count_tokens": [1, 2]}, "count_tokens must be a function, not list"),
    ({"embedding_limits": (384, 512)}, "embedding_limits must be a function, not tuple"),
    ({"vocabulary_size": 30522}, "vocabulary_size must be a function, not int"),
    ({"get_engine": TensorSpec}, "get_engine must be a function, not type"),
    ({"INPUT_TENSORS": SPECS_IN}, "declares INPUT_TENSORS but not OUTPUT_TENSORS; a tensor model declares both"),
    ({"OUTPUT_TENSORS": SPECS_OUT}, "declares OUTPUT_TENSORS but not INPUT_TENSORS; a tensor model declares both"),
    ({"INPUT_TENSORS": "INPUT0", "OUTPUT_TENSORS": SPECS_OUT}, "INPUT_TENSORS must be a non-empty list of TensorSpec"),
    ({"INPUT_TENSORS": SPECS_IN, "OUTPUT_TENSORS": []}, "OUTPUT_TENSORS must be a non-empty list of TensorSpec"),
    ({"INPUT_TENSORS": SPECS_IN, "OUTPUT_TENSORS": TensorSpec("OUTPUT0", "INT32")},
     "OUTPUT_TENSORS must be a non-empty list of TensorSpec"),
    ({"INPUT_TENSORS": [("INPUT0", "INT32", [-1])], "OUTPUT_TENSORS": SPECS_OUT},
     r"INPUT_TENSORS holds \('INPUT0', 'INT32', \[-1\]\), which is no TensorSpec"),
    ({"INPUT_TENSORS": SPECS_IN * 2, "OUTPUT_TENSORS": SPECS_OUT}, "INPUT_TENSORS declares INPUT0 more than once"),
])
def test_invalid_declarations_are_refused_naming_module_and_attribute(attributes, message):
    with pytest.raises(HandlerDeclarationError, match=message) as failure:
        HandlerCapabilities.read(module(**{"handle": handle, **attributes}))
    assert "handler module handler_under_test" in str(failure.value)
    assert isinstance(failure.value, HandlerLoadError)  # a handler that cannot load, like an import error


def test_the_error_names_the_file_of_a_module_loaded_from_one(tmp_path):
    (tmp_path / "model.py").write_text("INPUT_TENSORS = []\ndef handle(inputs):\n    return None\n")
    loaded = resolve_handler("m", str(tmp_path), None, "text-generation")
    with pytest.raises(HandlerDeclarationError, match=f"{tmp_path / 'model.py'}"):
        HandlerCapabilities.read(loaded.module, loaded.function_name)


# --- the loader says what it loaded -------------------------------------------------------------

def test_the_loader_marks_built_ins_and_the_model_py_they_serve():
    user_served = resolve_handler("formatted", str(FIXTURES / "formatted_model"), None, "text-generation")
    assert user_served.builtin and user_served.function_name == "handle"
    assert user_served.user_module is not None and hasattr(user_served.user_module, "from_question")
    custom = resolve_handler("custom", str(FIXTURES / "custom_model"), None, "text-generation")
    assert not custom.builtin and custom.user_module is None
    for task in ("text-generation", "text-embedding"):
        caps = HandlerCapabilities.read(resolve_handler("plain", None, None, task).module, builtin=True)
        assert caps.load is not None and caps.builtin
    generation = HandlerCapabilities.read(resolve_handler("plain", None, None, "text-generation").module, builtin=True)
    assert generation.supports_rolling_batch and generation.get_engine is not None
    embedding = HandlerCapabilities.read(resolve_handler("plain", None, None, "text-embedding").module, builtin=True)
    assert embedding.count_tokens and embedding.embedding_limits and embedding.vocabulary_size
    assert not embedding.supports_rolling_batch


# --- DJL's string properties, validated back into a ModelConfig ---------------------------------

def test_handler_properties_round_trip_to_the_same_config():
    config = ModelConfig(name="m", model_id="org/model", dtype="fp16", tensor_parallel_degree="max",
                         trust_remote_code=True, max_rolling_batch_size=7, predict_timeout=12.5, max_input_len=100,
                         options={"custom_greeting": "hi", "dtype": "fp16"})
    back = ModelConfig.from_handler_properties(config.handler_properties())
    assert back.model_dump(exclude={"options"}) == config.model_dump(exclude={"options"})
    assert back.options == {"custom_greeting": "hi"}  # fields are fields again; the rest stays an option
    assert back.max_rolling_batch_size == 7 and back.tensor_parallel_degree == "max" and back.trust_remote_code is True


def test_invalid_string_properties_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match="max_rolling_batch_size: 'many' is not an integer"):
        ModelConfig.from_handler_properties({"model_id": "x", "max_rolling_batch_size": "many"})


def test_typed_from_properties_gives_the_load_arguments():
    config, context = typed_from_properties({"model_id": "x"}, "text-embedding")
    assert config.name == "model" and config.model_id == "x" and config.max_rolling_batch_size == 32
    default_cache = ServerConfig.model_fields["cache_dir"].get_default(call_default_factory=True)
    assert context == HandlerContext(task="text-embedding", cache_dir=default_cache, rolling_batch=False)
    props = {**ModelConfig(name="m", model_id="x").handler_properties(), "task": "text-generation",
             "cache_dir": "/tmp/c", "model_name": "m", "rolling_batch": "scheduler"}
    config, context = typed_from_properties(props, "text-embedding")
    assert context == HandlerContext(task="text-generation", cache_dir="/tmp/c", rolling_batch=True)
    assert config.options == {"cache_dir": "/tmp/c", "model_name": "m"}


# --- the built-in text handler receives the ModelConfig typed -----------------------------------

class Recorder:
    """Stands in for a class and records the arguments of every instance."""

    made: list[Recorder] = []

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs
        Recorder.made.append(self)

    def start(self):
        return self


@pytest.fixture
def no_model(monkeypatch):
    """The built-in text handler without a model: load_generation_model, Engine and RollingBatchService are
    recorded, warm-up generation does nothing. Patched where the handler file (or engine/build.py, which
    it calls) imports them from, so a handler module loaded afterwards (by the service) gets the fakes."""
    import lmi_serve.dialects.lmi.rolling
    import lmi_serve.engine.build
    import lmi_serve.engine.engine
    import lmi_serve.engine.kv.slots
    import lmi_serve.engine.static_batch
    import lmi_serve.engine.sampling.watermark
    import lmi_serve.kernels.plan
    import lmi_serve.model.loader

    calls: dict = {}

    def load_generation_model(model_id, **kwargs):
        calls["load_generation_model"] = (model_id, kwargs)
        model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=1024, vocab_size=100))
        return SimpleNamespace(model=model, tokenizer=lambda text: SimpleNamespace(input_ids=[1, 2]), device="cpu",
                               source=str(model_id))

    class Engine(Recorder):
        pass

    class RollingBatchService(Recorder):
        pass

    class Watermark(Recorder):
        pass

    def plan_kernels(model, config, host, *, device, generates=True, q4_source=None, sharded=False):
        calls["use_linear_kernel"] = "torch" if sharded else config.linear_kernel
        calls["row_kernel"] = config.row_kernel
        return SimpleNamespace(summary=lambda: "Kernel plan: none (a test's fake)")

    monkeypatch.setattr(lmi_serve.model.loader, "load_generation_model", load_generation_model)
    monkeypatch.setattr(lmi_serve.kernels.plan, "plan_kernels", plan_kernels)
    monkeypatch.setattr(lmi_serve.engine.engine, "Engine", Engine)
    monkeypatch.setattr(lmi_serve.engine.build, "Engine", Engine)
    monkeypatch.setattr(lmi_serve.dialects.lmi.rolling, "RollingBatchService", RollingBatchService)
    monkeypatch.setattr(lmi_serve.engine.sampling.watermark, "Watermark", Watermark)
    monkeypatch.setattr(lmi_serve.engine.build, "Watermark", Watermark)
    monkeypatch.setattr(lmi_serve.engine.static_batch, "generate_static_batch", lambda *args: iter(()))
    monkeypatch.setattr(lmi_serve.engine.static_batch, "eos_token_ids", lambda model, tokenizer: frozenset({2}))
    monkeypatch.setattr(lmi_serve.engine.kv.slots, "slot_bytes", lambda model, rows, columns: 0)  # no weights
    monkeypatch.setattr(Recorder, "made", [])
    return SimpleNamespace(calls=calls, engines=Recorder.made, Engine=Engine, RollingBatchService=RollingBatchService)


def built_in_text_handler():
    return resolve_handler("typed", None, None, "text-generation").module


TYPED = ModelConfig(name="typed-model", model_id="org/model", gguf_file="m.gguf", dtype="bf16", device_map="auto",
                    tensor_parallel_degree="max", trust_remote_code=True, revision="main", task="text-generation",
                    rolling_batch="auto", max_rolling_batch_size=5, max_rolling_batch_prefill_tokens=64,
                    max_rolling_batch_step_seconds=0.3, job_queue_size=9, predict_timeout=3.5, max_model_len=4096,
                    max_input_len=200, tgi_compat=True, output_formatter="jsonlines", kv_cache="dynamic",
                    enable_prefix_caching=True, reasoning_parser="qwen3", max_reasoning_tokens=64,
                    tool_call_parser="llama3_json", trust_request_chat_template=True,
                    prefix_cache_mb=3, watermark_gamma=0.25, watermark_delta=1.5, linear_kernel="torch",
                    draft_model_id="ngram", spec_length=3, prompt_lookup_max=5, mixed_steps=False, row_kernel="off")


def engine_and_rolling(no_model) -> tuple[Recorder, Recorder]:
    engine = next(r for r in no_model.engines if isinstance(r, no_model.Engine))
    rolling = next(r for r in no_model.engines if isinstance(r, no_model.RollingBatchService))
    return engine, rolling


def test_typed_values_reach_the_model_loader_and_the_engine(no_model):
    handler = built_in_text_handler()
    handler.load(TYPED, HandlerContext(task="text-generation", cache_dir="/tmp/cache", rolling_batch=True))
    model_id, kwargs = no_model.calls["load_generation_model"]
    assert model_id == "org/model"
    assert kwargs == {"gguf_file": "m.gguf", "dtype": "bf16", "device_map": "auto", "tensor_parallel_degree": "max",
                      "revision": "main", "trust_remote_code": True, "cache_dir": "/tmp/cache"}
    assert no_model.calls["use_linear_kernel"] == "torch" and no_model.calls["row_kernel"] == "off"
    engine, rolling = engine_and_rolling(no_model)
    prefix_cache = engine.kwargs.pop("prefix_cache")
    assert isinstance(prefix_cache, PrefixCache) and prefix_cache.budget_bytes == 3 * 2**20
    speculation = engine.kwargs.pop("speculation")
    assert speculation.settings == NgramSettings(length=3, longest=5, shortest=2)
    watermark = engine.kwargs.pop("watermark")
    assert watermark.args == (100, "cpu", WatermarkSettings(gamma=0.25, delta=1.5))
    assert engine.kwargs == {"max_batch_size": 5, "max_queue": 9, "predict_timeout": 3.5, "max_prefill_tokens": 64,
                             "max_model_len": 1024, "name": "typed-model",  # max_model_len capped at the window
                             "kv_layout": DYNAMIC, "adapters": None,  # no LoRA
                             "kv_tokens": None, "mixed_steps": False,  # a CPU: no GPU memory budget
                             "step_seconds": 0.3, "generation_deadline": None}  # not on a SageMaker endpoint
    assert type(engine.kwargs["max_batch_size"]) is int and type(engine.kwargs["predict_timeout"]) is float
    assert rolling.args == (engine,)
    assert rolling.kwargs == {"max_input_len": 200, "tgi_compat": True, "output_formatter": "jsonlines",
                              "custom_input": None, "custom_output": None, "model_name": "typed-model",
                              "reasoning": ReasoningSettings("qwen3", 64), "tool_call_parser": "llama3_json",
                              "vision": None, "trust_request_template": True}  # a text model: no processor
    assert handler.get_engine() is engine


def test_defaults_come_from_the_model_config_and_dynamic_batching_makes_no_engine(no_model):
    handler = built_in_text_handler()
    handler.load(ModelConfig(name="m", model_id="x", enable_streaming=True),
                 HandlerContext(task="text-generation", cache_dir="/c", rolling_batch=False))
    assert no_model.calls["load_generation_model"][1]["tensor_parallel_degree"] == 1
    assert handler.get_engine() is None and not no_model.engines
    assert handler._service.streaming is True and handler._service.max_input_len == 1023
    assert handler._service.kv_layout is SLOTS  # the default, for dynamic batching too


def test_prefix_caching_without_a_rolling_batch_is_a_start_up_error(no_model):
    handler = built_in_text_handler()
    with pytest.raises(ValueError, match="^option.enable_prefix_caching: .*needs the rolling batch"):
        handler.load(ModelConfig(name="m", model_id="x", enable_prefix_caching=True),
                     HandlerContext(task="text-generation", cache_dir="/c", rolling_batch=False))


def test_djl_first_call_reaches_the_same_typed_load(no_model):
    """A model.py delegating to the built-in (tests/fixtures/faulty_model) sends string properties."""
    handler = built_in_text_handler()
    props = {**TYPED.handler_properties(), "task": "text-generation", "cache_dir": "/tmp/cache",
             "model_name": TYPED.name, "rolling_batch": "scheduler"}
    assert handler.handle(Input(properties=props)) is None
    engine, rolling = engine_and_rolling(no_model)
    assert engine.kwargs["max_batch_size"] == 5 and engine.kwargs["predict_timeout"] == 3.5
    assert rolling.kwargs["tgi_compat"] is True and rolling.kwargs["model_name"] == "typed-model"
    assert no_model.calls["load_generation_model"][1]["cache_dir"] == "/tmp/cache"


def test_the_service_calls_the_typed_load_with_its_config_and_the_model_py_hooks(no_model):
    # a local model_id: a Hub id would be downloaded first (model/download.py, test_hub_download.py)
    folder = str(FIXTURES / "formatted_model")
    config = TYPED.model_copy(update={"model_dir": folder, "model_id": folder})
    service = ModelService(config, "/tmp/cache")
    service.load()
    assert service.current_status() is ModelStatus.READY, service.error
    assert service.capabilities.builtin and service.capabilities.load is not None and service.rolling_batch
    engine, rolling = engine_and_rolling(no_model)
    assert service.engine is engine
    assert rolling.kwargs["custom_input"].__name__ == "from_question"
    assert rolling.kwargs["custom_output"].__name__ == "to_answer"


def write_model_py(folder: Path, source: str) -> ModelConfig:
    (folder / "model.py").write_text(textwrap.dedent(source))
    return ModelConfig(name="user", model_dir=str(folder), task="text-generation", rolling_batch="disable",
                       options={"custom_greeting": "hi"})


def test_a_user_model_py_keeps_djls_first_call_with_string_properties(tmp_path):
    config = write_model_py(tmp_path, """
        FIRST = []

        def load(config, context):
            raise AssertionError("never called for a model.py")

        def handle(inputs):
            if not FIRST:
                FIRST.append(inputs.get_properties())
            return None
    """)
    service = ModelService(config, "/tmp/cache")
    service.load()
    assert service.current_status() is ModelStatus.READY, service.error
    assert not service.capabilities.builtin and service.capabilities.load is None
    first = service.capabilities.handle.__globals__["FIRST"][0]
    assert first["custom_greeting"] == "hi" and first["batch_size"] == "1" and first["rolling_batch"] == "disable"
    assert first["cache_dir"] == "/tmp/cache" and first["model_name"] == "user" and first["task"] == "text-generation"


def test_an_invalid_declaration_fails_the_models_load(tmp_path):
    config = write_model_py(tmp_path, """
        from lmi_serve.tensor_model import TensorSpec

        INPUT_TENSORS = [TensorSpec("INPUT0", "INT32", [-1])]

        def handle(inputs):
            return None
    """)
    service = ModelService(config, "/tmp/cache")
    service.load()
    assert service.current_status() is ModelStatus.FAILED and service.capabilities is None
    assert service.error.startswith("HandlerDeclarationError: handler module")
    assert "declares INPUT_TENSORS but not OUTPUT_TENSORS" in service.error


def test_the_triton_contract_is_read_from_the_capabilities():
    from lmi_serve.dialects.triton.models import contract_for

    caps = HandlerCapabilities.read(module(handle=handle, INPUT_TENSORS=SPECS_IN, OUTPUT_TENSORS=SPECS_OUT))
    service = SimpleNamespace(engine=None, task="tensor", name="t", capabilities=caps)
    contract = contract_for(service)
    assert contract.kind == "tensor" and contract.inputs == tuple(SPECS_IN) and contract.outputs == tuple(SPECS_OUT)


@pytest.mark.parametrize("option", [{"quantize": "fp16"}, {"enable_prefix_caching": True}])
def test_the_embedding_handler_refuses_text_generation_options_by_name(option):
    handler = resolve_handler("plain", None, None, "text-embedding").module
    name = next(iter(option))
    with pytest.raises(ValueError, match=f"^option.{name}: not available for embedding models"):
        handler.load(ModelConfig(name="e", model_id="x", **option),
                     HandlerContext(task="text-embedding", cache_dir="/c", rolling_batch=False))
