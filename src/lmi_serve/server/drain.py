"""Graceful drain on SIGTERM, the way SageMaker and Kubernetes stop a container.

The master (`DrainingArbiter`, gunicorn's arbiter) keeps the listening socket open on the first
SIGTERM, so a load balancer's health checks and late requests get an answer rather than a refused
connection; it passes the SIGTERM on to every worker, spawns no replacement for a worker that
exits, and exits 0 once every worker has. A second SIGTERM (or SIGINT / SIGQUIT, as in gunicorn)
ends the workers at once, as does SERVING_GRACEFUL_TIMEOUT plus `HARD_STOP_MARGIN` should a worker
not have ended by itself.

In a worker (`WorkerDrain`), SIGTERM turns the health routes unhealthy at once and every new POST
(all inference routes are POSTs) into a 503 in the dialect of its route (app.py's gate); GET routes
other than health (metrics, model listing and description, server metadata) answer as usual, as
they never start model work. Requests already in flight, streams included, run to their end. The
worker stops when none is left, or at SERVING_GRACEFUL_TIMEOUT: then every rolling-batch row still
waiting or running is ended through the engine's failure path (each dialect renders that as its own
error status or final error event), and the worker stops once those responses are written (at most
`END_GRACE` seconds). Requests of a dynamic-batching handler cannot be ended early: the master's
hard stop cuts them.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable

from gunicorn.arbiter import Arbiter
from werkzeug.wsgi import ClosingIterator

from lmi_serve.errors import NotReady

log = logging.getLogger(__name__)

END_GRACE = 5.0  # seconds the ended requests get to write their error and close, after the deadline
HARD_STOP_MARGIN = END_GRACE + 10.0  # the master's allowance over the timeout: the engine's join, the worker's exit
QUICK_STOP = 2.0  # seconds the master gives workers told to quit (SIGQUIT) before it kills them


class WorkerDrain:
    """One worker's drain: counts the requests in flight (WSGI middleware) and, once SIGTERM came,
    refuses new work and stops the worker when the last one ends or at the deadline."""

    def __init__(self, registry, timeout: float):
        """`registry`: the worker's models (registry.ModelRegistry); its `stopping` flag makes the
        health routes unhealthy. `timeout`: seconds in-flight requests get (SERVING_GRACEFUL_TIMEOUT)."""
        self.registry = registry
        self.timeout = timeout
        self.draining = False
        self._in_flight = 0
        self._changed = threading.Condition()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def track(self, wsgi_app: Callable) -> Callable:
        """Wrap a WSGI app: a request counts from its call until its body is closed (gunicorn closes
        it after the last byte, or when the client went away), so a stream counts while it runs."""
        def tracked(environ, start_response) -> Iterable[bytes]:
            with self._changed:
                self._in_flight += 1
            try:
                body = wsgi_app(environ, start_response)
            except BaseException:
                self._finished()
                raise
            return ClosingIterator(body, self._finished)

        return tracked

    def _finished(self) -> None:
        with self._changed:
            self._in_flight -= 1
            self._changed.notify_all()

    def refuse_new_work(self, method: str) -> None:
        """The app's gate, before every request: raise NotReady (503 in every dialect) for a POST
        while draining."""
        if self.draining and method == "POST":
            raise NotReady("The server is shutting down and accepts no new requests; send it to another instance")

    def begin(self, stop_worker: Callable[[], None]) -> None:
        """SIGTERM in this worker: start draining (a second call does nothing). Called from the
        signal handler, so it only flips flags and starts a thread; `stop_worker()` is called on that
        thread when the drain is over (gunicorn's own SIGTERM handling: stop accepting, then exit)."""
        if self.draining:
            return
        self.draining = True
        self.registry.stopping = True
        threading.Thread(target=self._drain, args=(stop_worker,), name="drain", daemon=True).start()

    def _drain(self, stop_worker: Callable[[], None]) -> None:
        log.info("SIGTERM: draining %d request(s) in flight, for at most %g s", self._in_flight, self.timeout)
        if not self._wait_idle(self.timeout):
            log.warning("Graceful timeout (%g s) reached with %d request(s) in flight: ending them",
                        self.timeout, self._in_flight)
            self.end_requests()
            self._wait_idle(END_GRACE)
        log.info("Drained; the worker stops")
        stop_worker()

    def _wait_idle(self, seconds: float) -> bool:
        """Wait until no request is in flight, for at most `seconds`; whether none is."""
        with self._changed:
            return self._changed.wait_for(lambda: self._in_flight <= 0, timeout=seconds)

    def end_requests(self) -> None:
        """End every rolling-batch row still waiting or running with a NotReady failure."""
        reason = (f"The server shut down before this request finished (its graceful timeout, "
                  f"SERVING_GRACEFUL_TIMEOUT={self.timeout:g} s, ran out)")
        for service in self.registry.services.values():
            if service.engine is not None:
                service.engine.stop(reason, NotReady)


def app_extensions(wsgi) -> dict:
    """The extensions of a worker's Flask app (`wsgi`: the app, or boot.BootingApp holding it); empty
    while the app is not built yet."""
    app = getattr(wsgi, "app", None) or wsgi
    return getattr(app, "extensions", None) or {}


def on_worker_sigterm(wsgi, stop_worker: Callable[[], None]) -> None:
    """A worker's SIGTERM handler: drain the worker's app, or, while the app is not built yet
    (nothing can be in flight), stop at once."""
    drain = app_extensions(wsgi).get("lmi_serve.server.drain")
    if drain is None:
        stop_worker()
    else:
        drain.begin(stop_worker)


def on_worker_exit(worker) -> None:
    """gunicorn's worker_exit hook, in the worker once its loop has ended (drained, or stopped at
    once): export the trace spans still queued (server/tracing.py), which would die with the process."""
    tracing = app_extensions(getattr(worker, "wsgi", None)).get("lmi_serve.server.tracing")
    if tracing is not None:
        tracing.shutdown()


class DrainingArbiter(Arbiter):
    """gunicorn's arbiter, draining on SIGTERM instead of closing the listening sockets at once."""

    draining_since: float | None = None

    def handle_term(self) -> None:
        if self.draining_since is None:
            self.log.info("SIGTERM: draining the workers (graceful timeout %g s)", self.cfg.graceful_timeout)
            self.draining_since = time.monotonic()
            self.kill_workers(signal.SIGTERM)
            return
        self.log.info("Second SIGTERM: stopping at once")
        self.stop_now()

    def handle_int(self) -> None:
        """SIGINT (and SIGQUIT): stop at once. gunicorn's own would wait up to the graceful timeout
        for a worker whose stream thread holds up its exit."""
        self.stop_now()

    handle_quit = handle_int

    def manage_workers(self) -> None:
        """Outside a drain, gunicorn's (keep the number of workers); in a drain, exit once every
        worker has, and stop them at once past the graceful timeout and its margin."""
        if self.draining_since is None:
            super().manage_workers()
            return
        if not self.WORKERS:
            raise StopIteration  # run() halts: sockets closed, on_exit, exit status 0
        if time.monotonic() - self.draining_since > self.cfg.graceful_timeout + HARD_STOP_MARGIN:
            self.log.warning("Workers still running %g s after SIGTERM: stopping them", self.cfg.graceful_timeout)
            self.stop_now()

    def stop_now(self) -> None:
        """Tell the workers to quit, kill those still there after QUICK_STOP, and halt (status 0)."""
        self.kill_workers(signal.SIGQUIT)
        limit = time.monotonic() + QUICK_STOP
        while self.WORKERS and time.monotonic() < limit:
            self.reap_workers()
            time.sleep(0.05)
        self.kill_workers(signal.SIGKILL)
        raise StopIteration
