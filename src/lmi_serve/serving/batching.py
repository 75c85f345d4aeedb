"""The job queue in front of a handler, and dynamic batching of the jobs in it.

One thread per model replica owns the handler: it takes the first waiting job, then keeps
collecting until `batch_size` jobs are in hand or `max_batch_delay` ms have passed since it took
the first, and makes one `handle()` call for all of them. Request threads only enqueue and wait,
so `/ping` and other routes are never blocked by inference.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from lmi_serve.errors import Overloaded, ServingError, Timeout
from lmi_serve.handler_api import Input, Output

log = logging.getLogger(__name__)

_END = object()


def is_out_of_memory(exc: BaseException) -> bool:
    text = str(exc)
    return (isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"
            or "CUDA error: out of memory" in text or "No available memory for the cache blocks" in text)


def call_handler(handle: Callable[[Input], Output | None], request: Input, name: str) -> Output:
    """Run a handler with DJL's result rules: None is 204, a non-Output is an error, and an
    exception is 424 (507 for out-of-memory). ServingErrors (e.g. Overloaded) propagate."""
    try:
        output = handle(request)
    except ServingError:
        raise
    except Exception as exc:  # the handler's failure is the requests' failure, never the server's
        log.exception("%s: handler failed", name)
        return failure_output(exc)
    if output is None:
        return Output(code=204, message="No content")
    if not isinstance(output, Output):
        return Output().error(f"handler returned {type(output).__name__}, not Output")
    return output


def failure_output(exc: BaseException) -> Output:
    """The LMI shape of a handler exception: 507 for out-of-memory, else 424."""
    if is_out_of_memory(exc):
        return Output().error(str(exc) or type(exc).__name__, code=507, message="out of memory")
    return Output().error(str(exc) or type(exc).__name__)


@dataclass
class Job:
    """One request waiting for its Output. A streamed Output's chunks arrive on `chunks`."""

    input: Input
    deadline: float
    ready: threading.Event = field(default_factory=threading.Event)
    output: Output | None = None
    error: ServingError | None = None  # the handler raised one of the core's error kinds instead
    chunks: queue.Queue = field(default_factory=queue.Queue)
    cancelled: bool = False

    def finish(self, output: Output) -> None:
        self.output = output
        self.ready.set()

    def fail(self, error: ServingError) -> None:
        """End the job with an error kind; the route raises it and the dialect renders it."""
        self.error = error
        self.ready.set()

    def stream(self) -> Iterator[bytes]:
        """Chunks of a streamed output, for the request thread. Closing the iterator cancels the job."""
        try:
            while (chunk := self.chunks.get()) is not _END:
                yield chunk
        finally:
            self.cancelled = True


class DirectJob(Job):
    """A job whose handler already ran on the request thread; its stream is consumed right here,
    and closing it closes the handler's generator (which cancels the engine request)."""

    def stream(self) -> Iterator[bytes]:
        assert self.output is not None
        chunks = self.output.iter_stream_chunks()
        try:
            yield from chunks
        finally:
            chunks.close()
            self.output.run_finalizers()


@dataclass
class BatchStats:
    """Counters exposed on GET /models/<m>, e.g. to show that requests shared one forward."""

    batches: int = 0
    requests: int = 0
    largest_batch: int = 0
    last_batch_size: int = 0

    def record(self, size: int) -> None:
        self.batches += 1
        self.requests += size
        self.largest_batch = max(self.largest_batch, size)
        self.last_batch_size = size


class DynamicBatcher:
    def __init__(self, name: str, handle: Callable[[Input], Output | None], *, batch_size: int,
                 max_batch_delay_ms: int, job_queue_size: int, predict_timeout: float):
        self.name = name
        self._handle = handle
        self.batch_size = batch_size
        self._delay = max_batch_delay_ms / 1000.0
        self._timeout = predict_timeout
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=job_queue_size)
        self.stats = BatchStats()
        self.busy = False  # a batch is in handle() now
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"batcher-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def idle(self) -> bool:
        return not self.busy and self._queue.empty()

    def stop(self, error: ServingError) -> None:
        """End the batching thread after the batch it runs; jobs still queued fail with `error`
        (the model is being unloaded: serving/multi_model.py)."""
        self._stopping = True
        try:
            self._queue.put_nowait(None)  # wakes _collect
        except queue.Full:
            pass
        self._thread.join(timeout=30)
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.fail(error)

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def submit(self, request: Input) -> Job:
        job = Job(request, time.monotonic() + self._timeout)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise Overloaded(f"Worker queue capacity exceeded for model: {self.name}") from None
        return job

    def wait(self, job: Job) -> Output:
        """Block the request thread until the job's Output (or its stream's headers) is ready."""
        if not job.ready.wait(max(0.0, job.deadline - time.monotonic())):
            job.cancelled = True
            raise Timeout(f"Prediction for model {self.name} timed out after {self._timeout:g} s")
        if job.error is not None:
            raise job.error
        assert job.output is not None
        return job.output

    def _collect(self) -> list[Job]:
        jobs = [self._queue.get()]
        until = time.monotonic() + self._delay
        while len(jobs) < self.batch_size and jobs[-1] is not None:
            try:
                jobs.append(self._queue.get(timeout=max(0.0, until - time.monotonic())))
            except queue.Empty:
                break
        live = [job for job in jobs if job is not None and not job.cancelled and time.monotonic() < job.deadline]
        return live

    def _run(self) -> None:
        while not self._stopping:
            jobs = self._collect()
            if jobs:
                self.stats.record(len(jobs))
                self.busy = True
                try:
                    self._run_batch(jobs)
                finally:
                    self.busy = False

    def _run_batch(self, jobs: list[Job]) -> None:
        batched = self.batch_size > 1
        request = Input.batch_of([j.input for j in jobs]) if batched else jobs[0].input
        try:
            output = call_handler(self._handle, request, self.name)
        except ServingError as exc:  # the whole batch shares one handle() call, so it shares the error
            for job in jobs:
                job.fail(exc)
            return
        outputs = output.get_batch_outputs(len(jobs)) if batched else [output]
        for job, out in zip(jobs, outputs):
            if out.is_stream():
                self._pump_stream(job, out)
            else:
                job.finish(out)
        output.run_finalizers()

    def _pump_stream(self, job: Job, output: Output) -> None:
        """Run a streamed Output on this thread (it holds the model) and hand chunks over."""
        job.finish(output)
        chunks = output.iter_stream_chunks()
        try:
            for chunk in chunks:
                if job.cancelled:
                    break
                job.chunks.put(chunk)
        finally:
            close = getattr(chunks, "close", None)
            if close:
                close()
            job.chunks.put(_END)


class DirectDispatcher:
    """Rolling-batch models: the built-in handler is thread-safe and hands each request to the
    engine itself, so it runs on the request thread and nothing queues here."""

    def __init__(self, name: str, handle: Callable[[Input], Output | None]):
        self.name = name
        self._handle = handle
        self.stats = BatchStats()
        self.queued = 0
        self.idle = True  # its requests are the engine's: the engine says when it is idle

    def stop(self, error: ServingError) -> None:
        """Nothing queues here; the engine ends its own requests (Engine.stop)."""

    def submit(self, request: Input) -> Job:
        job = DirectJob(request, deadline=float("inf"))
        self.stats.record(1)
        job.finish(call_handler(self._handle, request, self.name))
        return job

    def wait(self, job: Job) -> Output:
        assert job.output is not None
        return job.output
