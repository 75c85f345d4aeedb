"""BootingApp: what a worker answers while it imports the application.

gunicorn accepts connections in a worker only once the worker has loaded its WSGI app, and importing
ours (the dialects import the engine, hence torch and transformers) takes seconds: meanwhile a
request, /ping included, would wait unanswered in the listen backlog. So the worker's app is this
light stand-in, which imports and builds the real one on a thread and answers at once meanwhile:
`GET /ping` with its usual loading answer (503, every configured model "Loading"), `GET /metrics` as
usual (it reads the workers' counter files) unless it needs an API key, any other request with 503 and the JSON body the HTTP
layer uses before any dialect is known (http_worker.py), and `Retry-After`. Once the real app is
built, every request goes to it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

APP_LOAD_ERROR = 4  # gunicorn's Arbiter.APP_LOAD_ERROR: the master stops instead of respawning the worker
STARTING = "The server is starting; retry shortly"


class BootingApp:
    """A WSGI app answering 503 until `create()` (run on a thread) has returned the real one."""

    def __init__(self, model_names: Iterable[str], create: Callable[[], Callable],
                 metrics: Callable[[], tuple[bytes, str]] | None):
        """`metrics()`: the /metrics (body, content type); None when /metrics needs an API key
        (security.py), which only the real app checks: then it is a 503 like the rest meanwhile."""
        self.app: Callable | None = None  # the real WSGI app (a Flask app), once built
        self.metrics = metrics
        self._ping = json.dumps({name: {"status": "Loading"} for name in model_names}).encode()
        threading.Thread(target=self._build, args=(create,), name="app-import", daemon=True).start()

    def _build(self, create: Callable[[], Callable]) -> None:
        try:
            self.app = create()
        except BaseException:
            log.exception("Worker %d: the application failed to load", os.getpid())
            logging.shutdown()
            os._exit(APP_LOAD_ERROR)  # as a failing app load does in gunicorn: the server stops

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        app = self.app
        if app is not None:
            return app(environ, start_response)
        get = environ.get("REQUEST_METHOD") == "GET"
        if get and environ.get("PATH_INFO") == "/metrics" and self.metrics is not None:
            body, content_type = self.metrics()
            start_response("200 OK", [("Content-Type", content_type), ("Content-Length", str(len(body)))])
            return [body]
        if get and environ.get("PATH_INFO") == "/ping":
            body = self._ping
        else:
            body = json.dumps({"code": 503, "type": "ServiceUnavailableException", "message": STARTING,
                               "error": STARTING}).encode()
        start_response("503 Service Unavailable", [("Content-Type", "application/json"),
                                                   ("Content-Length", str(len(body))), ("Retry-After", "1")])
        return [body]
