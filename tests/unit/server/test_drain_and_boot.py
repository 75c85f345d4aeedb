"""The worker's drain (drain.WorkerDrain) and its boot stand-in (boot.BootingApp), without a server:
WSGI calls by hand. tests/integration/ops/test_drain.py and test_startup.py run them in the real server."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

from lmi_serve.config.sources import ModelConfig
from lmi_serve.errors import NotReady
from lmi_serve.server.boot import BootingApp
from lmi_serve.server.drain import WorkerDrain
from lmi_serve.serving.registry import ModelRegistry
from lmi_serve.serving.service import ModelService, ModelStatus
from server_process import wait_for

WAIT = 30


def gated_stream(gate: threading.Event):
    """A WSGI app whose body's second chunk waits for `gate`: a stream in flight."""
    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/event-stream")])

        def body():
            yield b"data: 1\n\n"
            gate.wait(WAIT)
            yield b"data: 2\n\n"

        return body()

    return app


def registry() -> ModelRegistry:
    return ModelRegistry([ModelService(ModelConfig(name="m"), cache_dir="/nonexistent")])


def test_a_drain_refuses_new_work_and_stops_the_worker_when_the_stream_in_flight_ends():
    drain, gate, stopped = WorkerDrain(registry(), timeout=WAIT), threading.Event(), threading.Event()
    body = drain.track(gated_stream(gate))({}, lambda status, headers: None)
    chunks = iter(body)
    assert next(chunks) == b"data: 1\n\n" and drain.in_flight == 1
    drain.refuse_new_work("POST")  # not draining yet: nothing refused
    drain.begin(stopped.set)
    drain.begin(stopped.set)  # a second SIGTERM in the worker changes nothing
    assert drain.registry.health() == (ModelStatus.STOPPING, {"m": {"status": "Stopping"}})
    with pytest.raises(NotReady, match="shutting down"):
        drain.refuse_new_work("POST")
    drain.refuse_new_work("GET")  # listings, metrics: still answered
    assert not stopped.wait(0.2)  # the stream is still in flight
    gate.set()
    assert list(chunks) == [b"data: 2\n\n"]
    body.close()  # gunicorn closes the body after its last byte
    assert stopped.wait(WAIT) and drain.in_flight == 0


def test_at_the_deadline_the_engine_ends_its_rows_then_the_worker_stops():
    gate, stopped, ended = threading.Event(), threading.Event(), []

    def stop(reason, kind):  # the engine's failure path ends the stream (here: opens its gate)
        ended.append((reason, kind))
        gate.set()

    service = SimpleNamespace(engine=SimpleNamespace(stop=stop))
    drain = WorkerDrain(SimpleNamespace(services={"m": service}, stopping=False), timeout=0.1)
    body = drain.track(gated_stream(gate))({}, lambda status, headers: None)
    chunks = iter(body)
    next(chunks)

    def client() -> None:  # reads to the end, then gunicorn closes the body
        list(chunks)
        body.close()

    threading.Thread(target=client, daemon=True).start()
    drain.begin(stopped.set)
    assert stopped.wait(WAIT)
    [(reason, kind)] = ended
    assert kind is NotReady and "SERVING_GRACEFUL_TIMEOUT=0.1 s" in reason


def call(app, method: str, path: str) -> tuple[str, dict, bytes]:
    seen = {}
    body = b"".join(app({"REQUEST_METHOD": method, "PATH_INFO": path},
                        lambda status, headers: seen.update(status=status, headers=dict(headers))))
    return seen["status"], seen["headers"], body


def test_booting_app_answers_at_once_until_the_real_app_is_built():
    release = threading.Event()

    def real(environ, start_response):
        start_response("200 OK", [])
        return [b"real"]

    def create():
        release.wait(WAIT)  # the imports
        return real

    app = BootingApp(["a", "b"], create, lambda: (b"# metrics\n", "text/plain; version=0.0.4"))
    status, headers, body = call(app, "GET", "/ping")
    assert status.startswith("503") and headers["Content-Type"] == "application/json"
    assert json.loads(body) == {"a": {"status": "Loading"}, "b": {"status": "Loading"}}
    status, headers, body = call(app, "POST", "/v1/chat/completions")
    assert status.startswith("503") and headers["Retry-After"] == "1"
    assert json.loads(body)["type"] == "ServiceUnavailableException"
    assert call(app, "GET", "/metrics")[::2] == ("200 OK", b"# metrics\n")
    guarded = BootingApp(["a"], lambda: release.wait(WAIT), None)  # /metrics needs a key: not before the gate
    assert call(guarded, "GET", "/metrics")[0].startswith("503")
    release.set()
    wait_for(lambda: app.app is not None, timeout=WAIT)
    assert call(app, "GET", "/ping")[::2] == ("200 OK", b"real")
