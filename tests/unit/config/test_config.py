"""Unit tests for lmi_serve.config.sources: sources, precedence, validation messages and discovery."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from lmi_serve.config import sources as config
from lmi_serve.config.sources import (
    ConfigError, ModelConfig, ServerConfig, build_server_config, load_model_config, read_properties,
)


def model_folder(root: Path, name: str, properties: str | None = None, *,
                 files: tuple[str, ...] = ()) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    if properties is not None:
        (folder / "serving.properties").write_text(properties)
    for file in files:
        (folder / file).write_text("{}")
    return folder


def load(tmp_path: Path, properties: str = "", env: dict[str, str] | None = None) -> ModelConfig:
    folder = model_folder(tmp_path, "m", "option.model_id=org/tiny\n" + properties)
    return load_model_config(folder, env or {})


def synth(**env: str) -> ModelConfig:
    return load_model_config(None, {"HF_MODEL_ID": "org/tiny", **env})


# --- read_properties --------------------------------------------------------------------------

def test_read_properties_subset(tmp_path: Path) -> None:
    path = tmp_path / "serving.properties"
    path.write_text(
        "# comment\n! also a comment\n\n"
        "  option.model_id = s3://bucket/path=x  \n"
        "engine: Python\n"
        "option.env=A=1:B\n"
        "lonely\n"
    )
    assert read_properties(path) == {
        "option.model_id": "s3://bucket/path=x", "engine": "Python", "option.env": "A=1:B", "lonely": "",
    }


def test_read_properties_missing_file(tmp_path: Path) -> None:
    assert read_properties(tmp_path / "nope.properties") == {}


# --- precedence -------------------------------------------------------------------------------

def test_properties_beat_option_env(tmp_path: Path) -> None:
    m = load(tmp_path, "option.dtype=fp16\noption.foo=file\n", {"OPTION_DTYPE": "bf16", "OPTION_FOO": "env"})
    assert m.dtype == "fp16"
    assert m.options["foo"] == "file"


def test_env_fills_what_properties_left_unset(tmp_path: Path) -> None:
    m = load(tmp_path, "option.dtype=fp16\n", {"OPTION_MAX_ROLLING_BATCH_SIZE": "8"})
    assert (m.dtype, m.max_rolling_batch_size) == ("fp16", 8)


def test_option_env_beats_hf_model_id() -> None:
    m = load_model_config(None, {"HF_MODEL_ID": "org/hf", "OPTION_MODEL_ID": "org/option"})
    assert m.model_id == "org/option"


def test_hf_variables_map_to_options() -> None:
    m = synth(HF_REVISION="abc123", HF_TASK="text-embedding")
    assert (m.model_id, m.revision, m.task, m.model_dir) == ("org/tiny", "abc123", "text-embedding", None)
    assert synth(OPTION_REVISION="r2", HF_REVISION="r1").revision == "r2"


def test_serving_env_keys() -> None:
    m = synth(SERVING_BATCH_SIZE="4", SERVING_MAX_BATCH_DELAY="7", SERVING_JOB_QUEUE_SIZE="12",
              SERVING_MIN_WORKERS="2", SERVING_MAX_WORKERS="3")
    assert (m.batch_size, m.max_batch_delay, m.job_queue_size) == (4, 7, 12)
    assert (m.min_workers, m.max_workers) == (2, 3)
    assert synth(SERVING_BATCH_SIZE="4", OPTION_MAX_DYNAMIC_BATCH_SIZE="2").batch_size == 2
    # among OPTION_* spellings of one field the canonical one wins
    assert synth(OPTION_MAX_DYNAMIC_BATCH_SIZE="2", OPTION_BATCH_SIZE="3").batch_size == 3


def test_bare_and_aliased_property_keys(tmp_path: Path) -> None:
    m = load(tmp_path, "max_dynamic_batch_size=3\nmax_batch_delay=5\njob_queue_size=9\n"
                       "minWorkers=2\nmaxWorkers=4\nengine=Python\nunrelated=1\n")
    assert (m.batch_size, m.max_batch_delay, m.job_queue_size) == (3, 5, 9)
    assert (m.min_workers, m.max_workers) == (2, 4)
    assert m.options["engine"] == "Python"
    assert "unrelated" not in m.options and "unrelated" not in m.handler_properties()


@pytest.mark.parametrize(("env", "expected"), [
    ({"SM_NUM_GPUS": "2"}, 2),
    ({"SM_NUM_GPUS": "2", "TENSOR_PARALLEL_DEGREE": "4"}, 4),
    ({"TENSOR_PARALLEL_DEGREE": "4", "OPTION_TENSOR_PARALLEL_DEGREE": "8"}, 8),
])
def test_tensor_parallel_env_precedence(env: dict[str, str], expected: int) -> None:
    assert synth(**env).tensor_parallel_degree == expected


def test_tgi_aliases_only_when_lmi_variable_unset() -> None:
    tgi = {"MAX_BATCH_SIZE": "5", "MAX_CONCURRENT_REQUESTS": "6", "HF_MODEL_TRUST_REMOTE_CODE": "true"}
    m = synth(**tgi)
    assert (m.max_rolling_batch_size, m.job_queue_size, m.trust_remote_code) == (5, 6, True)
    m = synth(**tgi, OPTION_MAX_ROLLING_BATCH_SIZE="50", SERVING_JOB_QUEUE_SIZE="60",
              OPTION_TRUST_REMOTE_CODE="false")
    assert (m.max_rolling_batch_size, m.job_queue_size, m.trust_remote_code) == (50, 60, False)


def test_timeout_precedence() -> None:
    sm = {"SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS": "30", "SAGEMAKER_STARTUP_TIMEOUT": "600"}
    assert (synth(**sm).predict_timeout, synth(**sm).model_loading_timeout) == (30.0, 600.0)
    assert synth(**sm, PREDICT_TIMEOUT="40").predict_timeout == 40.0
    assert synth(**sm, PREDICT_TIMEOUT="40", OPTION_PREDICT_TIMEOUT="50").predict_timeout == 50.0
    assert synth(**sm, MODEL_LOADING_TIMEOUT="700").model_loading_timeout == 700.0
    assert synth().predict_timeout == 120.0 and synth().model_loading_timeout == 240.0


def test_entry_point_spellings(tmp_path: Path) -> None:
    m = synth(OPTION_ENTRYPOINT="my.module")
    assert m.entry_point == "my.module" and m.options["entryPoint"] == "my.module"
    assert synth(DJL_ENTRY_POINT="djl.module").entry_point == "djl.module"
    assert synth(DJL_ENTRY_POINT="djl.module", OPTION_ENTRYPOINT="opt.module").entry_point == "opt.module"
    from_file = load(tmp_path, "option.entryPoint=file.module\n", {"OPTION_ENTRYPOINT": "env"})
    assert from_file.entry_point == "file.module"


def test_blank_property_values_count_as_unset(tmp_path: Path) -> None:
    m = load(tmp_path, "option.revision=\noption.dtype =\n", {"HF_REVISION": "r1"})
    assert (m.revision, m.dtype) == ("r1", "auto")
    assert "dtype" not in m.options


def test_blank_env_values_count_as_unset() -> None:
    assert synth(OPTION_DTYPE="", TENSOR_PARALLEL_DEGREE="  ").dtype == "auto"
    assert load_model_config(None, {"OPTION_MODEL_ID": " ", "HF_MODEL_ID": "org/x"}).model_id == "org/x"


# --- value parsing ----------------------------------------------------------------------------

@pytest.mark.parametrize(("raw", "expected"),
                         [("4", 4), ("1", 1), ("max", "max"), ("MAX", "max"), ("-1", "max")])
def test_tensor_parallel_values(raw: str, expected: int | str) -> None:
    assert synth(OPTION_TENSOR_PARALLEL_DEGREE=raw).tensor_parallel_degree == expected


@pytest.mark.parametrize("raw", ["0", "-2", "two", "1.5"])
def test_tensor_parallel_invalid(raw: str) -> None:
    with pytest.raises(ConfigError, match=r"^TENSOR_PARALLEL_DEGREE: .*'max'"):
        synth(TENSOR_PARALLEL_DEGREE=raw)


@pytest.mark.parametrize(("raw", "expected"), [
    ("true", True), ("TRUE", True), ("1", True), ("yes", True), ("Yes", True),
    ("false", False), ("False", False), ("0", False), ("no", False), ("NO", False),
])
def test_bool_parsing(raw: str, expected: bool) -> None:
    m = synth(OPTION_TRUST_REMOTE_CODE=raw, OPTION_TGI_COMPAT=raw, OPTION_ENABLE_STREAMING=raw)
    assert (m.trust_remote_code, m.tgi_compat, m.enable_streaming) == (expected, expected, expected)


def test_bool_invalid(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^option\.trust_remote_code: 'maybe' is not a boolean"):
        load(tmp_path, "option.trust_remote_code=maybe\n")


@pytest.mark.parametrize("raw", ["huggingface", "HuggingFace", "true"])
def test_enable_streaming_accepts_huggingface(raw: str) -> None:
    assert synth(OPTION_ENABLE_STREAMING=raw).enable_streaming is True


def test_enum_values_are_case_insensitive() -> None:
    m = synth(OPTION_DTYPE="FP16", OPTION_ROLLING_BATCH="Disable", HF_TASK="Text-Generation")
    assert (m.dtype, m.rolling_batch, m.task) == ("fp16", "disable", "text-generation")
    assert synth().rolling_batch == "auto"  # kept as given; the server resolves it


# --- invalid values name the key as written ---------------------------------------------------

def test_invalid_dtype_from_env_names_env_key() -> None:
    with pytest.raises(ConfigError) as info:
        synth(OPTION_DTYPE="fp17")
    assert str(info.value) == "OPTION_DTYPE: 'fp17' is not one of fp32, fp16, bf16, auto"


def test_invalid_rolling_batch_from_properties(tmp_path: Path) -> None:
    expected = r"^option\.rolling_batch: 'foo' is not one of auto, scheduler, disable"
    with pytest.raises(ConfigError, match=expected):
        load(tmp_path, "option.rolling_batch=foo\n")


def test_tool_call_parser_is_unset_by_default_and_checked(tmp_path: Path) -> None:
    assert synth().tool_call_parser is None
    assert synth(OPTION_TOOL_CALL_PARSER="Llama3_JSON").tool_call_parser == "llama3_json"
    assert load(tmp_path, "option.tool_call_parser=mistral\n").tool_call_parser == "mistral"
    with pytest.raises(ConfigError) as info:
        synth(OPTION_TOOL_CALL_PARSER="llama4_json")
    assert str(info.value) == ("OPTION_TOOL_CALL_PARSER: 'llama4_json' is not one of hermes, llama3_json, mistral, "
                               "pythonic, qwen3_coder, openai, deepseek_v3, deepseek_v31, granite, gemma4")


def test_kv_cache_is_slots_by_default_and_checked() -> None:
    assert synth().kv_cache == "slots" and synth(OPTION_KV_CACHE="Dynamic").kv_cache == "dynamic"
    with pytest.raises(ConfigError, match=r"^OPTION_KV_CACHE: 'paged' is not one of slots, dynamic"):
        synth(OPTION_KV_CACHE="paged")


def test_prefix_caching_is_unset_by_default_and_checked(tmp_path: Path) -> None:
    # unset: on wherever the model can take it (engine/build.py; tests/unit/engine/test_build.py)
    assert synth().enable_prefix_caching is None and synth().prefix_cache_mb == 512
    assert synth(OPTION_ENABLE_PREFIX_CACHING="false").enable_prefix_caching is False
    config = synth(OPTION_ENABLE_PREFIX_CACHING="true", OPTION_PREFIX_CACHE_MB="64")
    assert config.enable_prefix_caching is True and config.prefix_cache_mb == 64
    with pytest.raises(ConfigError, match=r"^OPTION_PREFIX_CACHE_MB: '0' must be >= 1"):
        synth(OPTION_PREFIX_CACHE_MB="0")
    with pytest.raises(ConfigError, match=r"^option\.enable_prefix_caching: prefix caching needs the rolling batch"):
        load(tmp_path, "option.enable_prefix_caching=true\noption.rolling_batch=disable\n")


def test_ngram_speculation_is_off_by_default_and_checked(tmp_path: Path) -> None:
    assert synth().draft_model_id is None and synth().spec_length == 0
    config = synth(OPTION_DRAFT_MODEL_ID="[ngram]", OPTION_SPEC_LENGTH="6")  # vLLM's older spelling too
    assert (config.draft_model_id, config.spec_length, config.prompt_lookup_max, config.prompt_lookup_min) == \
        ("ngram", 6, 4, 2)
    with pytest.raises(ConfigError, match=r"^OPTION_DRAFT_MODEL_ID: 'facebook/opt-125m' is not served: only `ngram`"):
        synth(OPTION_DRAFT_MODEL_ID="facebook/opt-125m")
    with pytest.raises(ConfigError, match=r"^option\.spec_length: draft tokens need option\.draft_model_id=ngram"):
        load(tmp_path / "a", "option.spec_length=4\n")
    with pytest.raises(ConfigError, match=r"^OPTION_SPEC_LENGTH: '17' must be <= 16"):
        synth(OPTION_DRAFT_MODEL_ID="ngram", OPTION_SPEC_LENGTH="17")
    with pytest.raises(ConfigError, match=r"^option\.prompt_lookup_min: option\.prompt_lookup_min \(3\) is more"):
        load(tmp_path / "b", "option.draft_model_id=ngram\noption.prompt_lookup_min=3\noption.prompt_lookup_max=2\n")
    with pytest.raises(ConfigError, match=r"^option\.draft_model_id: speculation needs the rolling batch"):
        load(tmp_path / "c", "option.draft_model_id=ngram\noption.rolling_batch=disable\n")
    with pytest.raises(ConfigError, match=r"cannot be combined with option\.draft_model_id"):
        load(tmp_path / "d", "option.draft_model_id=ngram\noption.tensor_parallel_degree=2\n")


def test_batch_size_zero(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^batch_size: '0' must be >= 1"):
        load(tmp_path, "batch_size=0\n")
    with pytest.raises(ConfigError, match=r"^SERVING_BATCH_SIZE: '0' must be >= 1"):
        synth(SERVING_BATCH_SIZE="0")


def test_non_integer_job_queue_size(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^job_queue_size: 'lots' is not an integer"):
        load(tmp_path, "job_queue_size=lots\n")
    with pytest.raises(ConfigError, match=r"^MAX_CONCURRENT_REQUESTS: '1.5' is not an integer"):
        synth(MAX_CONCURRENT_REQUESTS="1.5")


def test_invalid_timeouts() -> None:
    with pytest.raises(ConfigError, match=r"^SAGEMAKER_STARTUP_TIMEOUT: 'soon' is not a number"):
        synth(SAGEMAKER_STARTUP_TIMEOUT="soon")
    with pytest.raises(ConfigError, match=r"^OPTION_PREDICT_TIMEOUT: '0' must be > 0"):
        synth(OPTION_PREDICT_TIMEOUT="0")


def test_every_bad_value_is_reported() -> None:
    with pytest.raises(ConfigError) as info:
        synth(OPTION_DTYPE="fp17", OPTION_MAX_INPUT_LEN="0")
    lines = str(info.value).splitlines()
    assert [line.split(":")[0] for line in lines] == ["OPTION_DTYPE", "OPTION_MAX_INPUT_LEN"]


def test_streaming_with_dynamic_batching(tmp_path: Path) -> None:
    expected = r"^option\.enable_streaming: We cannot enable streaming for dynamic batching"
    with pytest.raises(ConfigError, match=expected):
        load(tmp_path, "option.enable_streaming=true\nbatch_size=4\n")
    assert load(tmp_path / "ok", "option.enable_streaming=true\nbatch_size=1\n").enable_streaming


def test_max_workers_below_min_workers(tmp_path: Path) -> None:
    expected = r"^SERVING_MAX_WORKERS: max_workers \(2\) is less than min_workers \(3\)"
    with pytest.raises(ConfigError, match=expected):
        load(tmp_path, "minWorkers=3\n", {"SERVING_MAX_WORKERS": "2"})


# --- model_id inference -----------------------------------------------------------------------

def test_missing_model_id_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^option\.model_id: "):
        load_model_config(model_folder(tmp_path, "empty", "option.dtype=fp16\n"), {})
    with pytest.raises(ConfigError, match=r"^option\.model_id: "):
        load_model_config(None, {})


@pytest.mark.parametrize("weights", ["config.json", "tiny.Q8_0.gguf"])
def test_model_files_make_the_folder_the_model_id(tmp_path: Path, weights: str) -> None:
    folder = model_folder(tmp_path, "local", files=(weights,))
    assert load_model_config(folder, {}).model_id == str(folder)


def test_custom_handler_needs_no_model_id(tmp_path: Path) -> None:
    m = load_model_config(model_folder(tmp_path, "custom", files=("model.py",)), {})
    assert (m.model_id, m.name) == (None, "custom")
    assert load_model_config(model_folder(tmp_path, "ep", "option.entryPoint=pkg.mod\n"), {}).model_id is None


def test_model_dir_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^model_dir: "):
        load_model_config(tmp_path / "missing", {})


# --- naming -----------------------------------------------------------------------------------

def test_name_rules(tmp_path: Path) -> None:
    assert load(tmp_path).name == "m"
    named = model_folder(tmp_path, "other", "option.model_id=x\noption.model_name=chat\n")
    assert load_model_config(named, {}).name == "chat"
    assert load_model_config(named, {}, name="explicit").name == "explicit"
    assert synth().name == "tiny"
    assert load_model_config(None, {"HF_MODEL_ID": "HuggingFaceTB/SmolLM2-135M-Instruct"}).name == \
        "smollm2-135m-instruct"
    assert load_model_config(None, {"OPTION_MODEL_ID": "Org/Odd Name+v2/"}).name == "odd_name_v2"


def test_invalid_name(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, "x", "option.model_id=a\noption.model_name=bad name\n")
    with pytest.raises(ConfigError, match=r"^option\.model_name: 'bad name' is not a valid name"):
        load_model_config(folder, {})


# --- options, handler properties, immutability ------------------------------------------------

def test_unknown_options_recorded(tmp_path: Path) -> None:
    m = load(tmp_path, "option.speculative_draft=bnb\noption.entryPoint=x\n", {"OPTION_MY_FLAG": "1"})
    assert m.unknown_options == ("my_flag", "speculative_draft")
    assert m.options == {"model_id": "org/tiny", "speculative_draft": "bnb", "entryPoint": "x", "my_flag": "1"}


def test_handler_properties(tmp_path: Path) -> None:
    m = load(tmp_path, "option.dtype=FP32\noption.custom=v\noption.trust_remote_code=yes\n",
             {"TENSOR_PARALLEL_DEGREE": "max"})
    props = m.handler_properties()
    assert props["custom"] == "v"
    assert props["model_dir"] == str(tmp_path / "m")
    assert props["model_id"] == "org/tiny"
    assert props["dtype"] == "fp32"
    assert props["trust_remote_code"] == "true"
    assert props["tensor_parallel_degree"] == "max"
    assert props["batch_size"] == "1" and props["predict_timeout"] == "120.0"
    assert "revision" not in props  # unset (None) values are left out
    assert all(isinstance(v, str) and not k.startswith("option.") for k, v in props.items())


def test_model_config_is_frozen() -> None:
    with pytest.raises(ValidationError):
        synth().dtype = "fp16"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        ModelConfig(name="x", model_id="y", bogus=1)  # type: ignore[call-arg]


# --- server config ----------------------------------------------------------------------------

def server(**env: str) -> ServerConfig:
    return build_server_config({"HF_MODEL_ID": "org/tiny", **env})


def test_server_defaults(tmp_path: Path) -> None:
    s = server(HOME=str(tmp_path))
    assert (s.host, s.port, s.workers, s.threads) == ("127.0.0.1", 8080, 1, 64)
    assert (s.max_request_size, s.request_id_header) == (64 * 1024 * 1024, "x-request-id")
    assert s.cache_dir == str(tmp_path / ".cache" / "lmi-serve")
    assert server(LMI_SERVE_CACHE_DIR="~/c", HOME="/h").cache_dir == "/h/c"


def test_max_request_size_precedence() -> None:
    assert server(SAGEMAKER_MAX_PAYLOAD_IN_MB="6").max_request_size == 6 * 1024 * 1024
    assert server(SAGEMAKER_MAX_PAYLOAD_IN_MB="6", SAGEMAKER_MAX_REQUEST_SIZE="1000").max_request_size == 1000
    with pytest.raises(ConfigError, match=r"^SAGEMAKER_MAX_PAYLOAD_IN_MB: 'six'"):
        server(SAGEMAKER_MAX_PAYLOAD_IN_MB="six")


def test_workers_and_threads() -> None:
    assert server(SERVING_MAX_WORKERS="3").workers == 3
    assert server(SERVING_MAX_WORKERS="3", SAGEMAKER_NUM_MODEL_WORKERS="2").workers == 2
    assert server(SERVING_THREADS="8").threads == 8
    with pytest.raises(ConfigError, match=r"^SERVING_THREADS: '0' must be >= 1"):
        server(SERVING_THREADS="0")


def test_graceful_timeout() -> None:
    assert server().graceful_timeout == 30
    assert server(SERVING_GRACEFUL_TIMEOUT="2.5").graceful_timeout == 2.5
    with pytest.raises(ConfigError, match=r"^SERVING_GRACEFUL_TIMEOUT: '0' must be > 0"):
        server(SERVING_GRACEFUL_TIMEOUT="0")
    with pytest.raises(ConfigError, match=r"^SERVING_GRACEFUL_TIMEOUT: 'soon' is not a number"):
        server(SERVING_GRACEFUL_TIMEOUT="soon")


def test_port_and_host() -> None:
    assert server(PORT="9000").port == 9000
    assert server(PORT="9000", SERVING_PORT="9001").port == 9001
    sm = server(SERVING_PORT="9001", SAGEMAKER_BIND_TO_PORT="9002")
    assert (sm.host, sm.port) == ("0.0.0.0", 9002)
    cli = build_server_config({"HF_MODEL_ID": "x", "SAGEMAKER_BIND_TO_PORT": "9002"}, host="::1", port=7000)
    assert (cli.host, cli.port) == ("::1", 7000)
    with pytest.raises(ConfigError, match=r"^SERVING_PORT: '70000' must be <= 65535"):
        server(SERVING_PORT="70000")


def test_model_store_discovery(tmp_path: Path) -> None:
    store = tmp_path / "store"
    model_folder(store, "zeta", "option.model_id=org/z\n")
    model_folder(store, "alpha", files=("config.json",))
    model_folder(store, "beta", files=("model.py",))
    model_folder(store, "gguf", files=("w.gguf",))
    model_folder(store, "notes", files=("README.md",))
    model_folder(store, ".hidden", "option.model_id=h\n")
    (store / "stray.txt").write_text("x")
    s = build_server_config({"OPTION_DTYPE": "fp16"}, model_store=store)
    assert [m.name for m in s.models] == ["alpha", "beta", "gguf", "zeta"]
    assert all(m.dtype == "fp16" for m in s.models)  # env options apply to every model
    assert s.models[0].model_id == str(store / "alpha")


def test_model_store_uses_folder_names_even_with_model_name(tmp_path: Path) -> None:
    store = tmp_path / "store"
    model_folder(store, "a", "option.model_id=x\noption.model_name=same\n")
    model_folder(store, "b", "option.model_id=y\noption.model_name=same\n")
    assert [m.name for m in build_server_config({}, model_store=store).models] == ["a", "b"]


def test_model_store_errors(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^model_store: .*empty"):
        build_server_config({}, model_store=tmp_path / "empty")
    with pytest.raises(ConfigError, match=r"^model_store: .*missing"):
        build_server_config({}, model_store=tmp_path / "missing")
    store = tmp_path / "bad"
    model_folder(store, "m", "option.model_id=x\noption.dtype=fp17\n")
    with pytest.raises(ConfigError, match=r"^option\.dtype: 'fp17'.*model folder"):
        build_server_config({}, model_store=store)


def test_model_source_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "SAGEMAKER_MODEL_DIR", tmp_path / "opt-ml-model")
    defaults = tmp_path / "defaults"
    model_folder(defaults, "default-a", "option.model_id=d/a\n")
    model_folder(defaults, "default-b", "option.model_id=d/b\n")
    store = tmp_path / "store"
    model_folder(store, "s", "option.model_id=s\n")
    single = model_folder(tmp_path, "single", "option.model_id=x\nmodel_name=solo\n")

    def names(env: dict[str, str], **kw: Path) -> list[str]:
        return [m.name for m in build_server_config(env, default_store=defaults, **kw).models]

    assert names({"HF_MODEL_ID": "org/Hub-Model"}, model_dir=single, model_store=store) == ["solo"]
    assert names({"HF_MODEL_ID": "org/Hub-Model"}, model_store=store) == ["s"]
    assert names({"HF_MODEL_ID": "org/Hub-Model"}) == ["hub-model"]
    assert names({}) == ["default-a", "default-b"]
    model_folder(tmp_path, "opt-ml-model", files=("model.py",))
    assert names({}) == ["opt-ml-model"]
    sagemaker = build_server_config({"OPTION_MODEL_ID": "org/m"}).models[0]
    assert sagemaker.model_dir == str(tmp_path / "opt-ml-model")
    monkeypatch.setattr(config, "SAGEMAKER_MODEL_DIR", tmp_path / "absent")
    with pytest.raises(ConfigError, match=r"^HF_MODEL_ID: no model to serve"):
        build_server_config({})
    synthesized = build_server_config({"OPTION_MODEL_ID": "org/m"}, default_store=defaults).models
    assert [m.model_id for m in synthesized] == ["org/m"]


def test_sagemaker_model_dir_is_named_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = model_folder(tmp_path, "model", files=("config.json",))
    monkeypatch.setattr(config, "SAGEMAKER_MODEL_DIR", folder)
    assert build_server_config({}).models[0].name == "model"


def test_duplicate_and_empty_models_rejected() -> None:
    m = synth()
    with pytest.raises(ValidationError, match="duplicate model names: tiny"):
        ServerConfig(models=(m, m))
    with pytest.raises(ValidationError):
        ServerConfig(models=())


def test_describe_mentions_every_model_and_value(tmp_path: Path) -> None:
    store = tmp_path / "store"
    model_folder(store, "first", "option.model_id=org/one\noption.hf_token=sekrit\noption.extra=1\n")
    model_folder(store, "second", "option.model_id=org/two\noption.dtype=bf16\n")
    text = build_server_config({}, model_store=store, port=9100).describe()
    for needle in ("'first'", "'second'", "org/one", "org/two", "bf16", "9100", "extra", "max_request_size"):
        assert needle in text
    assert "sekrit" not in text


def test_json_round_trip(tmp_path: Path) -> None:
    store = tmp_path / "store"
    model_folder(store, "a", "option.model_id=org/a\noption.tensor_parallel_degree=max\noption.odd=1\n")
    model_folder(store, "b", "option.model_id=org/b\noption.enable_streaming=true\noption.max_model_len=64\n")
    original = build_server_config({"SERVING_THREADS": "4"}, model_store=store)
    text = original.to_json()
    assert json.loads(text)["threads"] == 4
    restored = ServerConfig.from_json(text)
    assert restored == original
    assert restored.models[0].unknown_options == ("odd",)
    assert restored.models[0].tensor_parallel_degree == "max"
    with pytest.raises(ConfigError, match=r"^models\.0\.dtype: 'fp17'"):
        ServerConfig.from_json(text.replace('"dtype":"auto"', '"dtype":"fp17"', 1))


def test_triton_server_name_comes_from_env() -> None:
    assert build_server_config({"HF_MODEL_ID": "x"}).triton_server_name == "triton"
    assert build_server_config({"HF_MODEL_ID": "x", "LMI_SERVE_TRITON_SERVER_NAME": "edge"}).triton_server_name == "edge"
    assert build_server_config({"HF_MODEL_ID": "x", "LMI_SERVE_TRITON_SERVER_NAME": ""}).triton_server_name == "triton"


def test_watermark_defaults_are_tgis_and_options_change_them(tmp_path: Path) -> None:
    assert (synth().watermark_gamma, synth().watermark_delta) == (0.5, 2.0)
    assert synth(WATERMARK_GAMMA="0.25", WATERMARK_DELTA="1").watermark_gamma == 0.25
    assert synth(OPTION_WATERMARK_DELTA="1.5", WATERMARK_DELTA="3").watermark_delta == 1.5
    assert load(tmp_path, "option.watermark_gamma=0.3\n").watermark_gamma == 0.3
    with pytest.raises(ConfigError, match=r"^WATERMARK_GAMMA: '1.5' .*less than 1"):
        synth(WATERMARK_GAMMA="1.5")
    with pytest.raises(ConfigError, match=r"^OPTION_WATERMARK_DELTA: '-1'"):
        synth(OPTION_WATERMARK_DELTA="-1")


def test_lora_options_are_off_by_default_and_checked(tmp_path: Path) -> None:
    default = synth()
    assert (default.enable_lora, default.max_loras, default.max_lora_rank, default.lora_dtype) == (False, 4, 64, "auto")
    config = synth(OPTION_ENABLE_LORA="true", OPTION_MAX_LORAS="2", OPTION_MAX_LORA_RANK="16", OPTION_LORA_DTYPE="BF16")
    assert (config.enable_lora, config.max_loras, config.max_lora_rank, config.lora_dtype) == (True, 2, 16, "bf16")
    with pytest.raises(ConfigError, match=r"^OPTION_MAX_LORAS: '0' must be >= 1"):
        synth(OPTION_MAX_LORAS="0")
    with pytest.raises(ConfigError, match=r"^OPTION_LORA_DTYPE: 'int8' is not one of auto, fp32, fp16, bf16"):
        synth(OPTION_LORA_DTYPE="int8")
    with pytest.raises(ConfigError, match=r"^option\.enable_lora: LoRA adapters need the rolling batch"):
        load(tmp_path, "option.enable_lora=true\noption.rolling_batch=disable\n")
    with pytest.raises(ConfigError, match=r"^SAGEMAKER_NUM_MODEL_WORKERS: option.enable_lora \(model tiny\) needs a single"):
        server(OPTION_ENABLE_LORA="true", SAGEMAKER_NUM_MODEL_WORKERS="2")


def test_pickled_weights_are_refused_by_default_and_the_option_is_a_checked_boolean(tmp_path: Path) -> None:
    assert synth().allow_pickled_weights is False
    assert synth(OPTION_ALLOW_PICKLED_WEIGHTS="true").allow_pickled_weights is True
    assert load(tmp_path, "option.allow_pickled_weights=yes\n").allow_pickled_weights is True
    with pytest.raises(ConfigError, match=r"^OPTION_ALLOW_PICKLED_WEIGHTS: 'sure' is not a boolean"):
        synth(OPTION_ALLOW_PICKLED_WEIGHTS="sure")


def test_reasoning_options_default_to_auto_unbounded_are_checked_and_reach_the_openai_service(tmp_path: Path) -> None:
    from lmi_serve.dialects.openai.reasoning import ReasoningSettings, reasoning_settings

    default = synth()
    assert (default.reasoning_parser, default.max_reasoning_tokens) == ("auto", None)
    config = load(tmp_path, "option.reasoning_parser=DeepSeek_R1\noption.max_reasoning_tokens=64\n")
    assert reasoning_settings(config) == ReasoningSettings("deepseek_r1", 64)
    with pytest.raises(ConfigError, match=r"^OPTION_REASONING_PARSER: 'r1' is not one of auto, none, deepseek_r1, qwen3"):
        synth(OPTION_REASONING_PARSER="r1")
    with pytest.raises(ConfigError, match=r"^OPTION_MAX_REASONING_TOKENS: '0' must be >= 1"):
        synth(OPTION_MAX_REASONING_TOKENS="0")
