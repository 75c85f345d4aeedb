"""One served model inside a worker process: its status, its handler, and its job queue.

Loading runs on a background thread when the worker starts, so `/ping` can answer "loading"
(not healthy) right away and "failed" if loading raised or outlived `model_loading_timeout`.
A Hub id or `s3://` model is downloaded first (model/download.py); the download does not count
against `model_loading_timeout`, which measures loading the local files.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from typing import Protocol

from lmi_serve.config.sources import ModelConfig
from lmi_serve.errors import InvalidRequest, NotReady
from lmi_serve.handler_api import Input, Output
from lmi_serve.model.download import fetch_model_files
from lmi_serve.model.source import ModelLoadError
from lmi_serve.model.task import GENERATION_TASKS, ENCODER_TASKS, ModelTaskError, TaskDecision, decide_task
from lmi_serve.serving.batching import DirectDispatcher, DynamicBatcher, Job
from lmi_serve.serving.handler_loader import resolve_handler
from lmi_serve.serving.handler_protocol import HandlerCapabilities, HandlerContext

log = logging.getLogger(__name__)

# Dynamic batching a built-in encoder handler gets when the user sets neither option (DJL's 1 / 100 ms
# stay for a model.py). As in TEI, nothing waits: the requests that queued while the last forward ran
# form the next one (up to 32 rows, where MiniLM's in-process throughput on a CPU stops growing), so a
# lone client pays no delay and concurrent ones share forwards. Rerankers and classifiers are the same
# kind of forward, and batch the same way.
ENCODER_BATCHING = {task: {"batch_size": 32, "max_batch_delay": 0} for task in sorted(ENCODER_TASKS)}


class ModelStatus(enum.Enum):
    LOADING = "Loading"
    READY = "Healthy"
    FAILED = "Failed"
    STOPPING = "Stopping"  # the server's, never a model's: SIGTERM came (registry.health, drain.py)


class ModelObserver(Protocol):
    """What watches a model (metrics.ModelMetrics): its load, and its engine's work (engine/observer.py)."""

    def model_loaded(self, seconds: float) -> None: ...


class ModelService:
    def __init__(self, config: ModelConfig, cache_dir: str, observer: ModelObserver | None = None,
                 on_request: Callable[[str], None] | None = None):
        """`observer` is told the load time and observes the rolling engine; `on_request(name)` is
        called whenever a request reaches this model (the HTTP layer labels its counts with it)."""
        self.config = config
        self.observer = observer
        self.on_request = on_request
        self.name = config.name
        self.cache_dir = cache_dir
        self.task: str | None = config.task or "text-generation"  # None: no task fits (the load fails)
        self.task_decision: TaskDecision | None = None  # set when loading begins (model/task.py)
        # What the files are loaded from: model_id, or the local copy of a Hub / S3 model once downloaded
        self.model_source: str | None = config.model_id
        self.status = ModelStatus.LOADING
        self.error: str | None = None
        self.started_at: float | None = None  # set when this model's loading begins
        self.loaded_at: float | None = None
        self.dispatcher: DynamicBatcher | DirectDispatcher | None = None
        self.rolling_batch = False
        self.engine = None  # the handler's rolling-batch Engine, for dialects that talk to it directly
        self.vision = None  # a vision-language model's serving/vision.VisionInputs (handler's get_vision)
        self.kernels = None  # what runs the forward here: kernels/plan.py's KernelPlan (handler's get_kernel_plan)
        self.capabilities: HandlerCapabilities | None = None  # what the handler declares (handler_protocol.py)

    def load(self) -> None:
        """Download the model if remote, then load the handler and model; never raises (a failure
        becomes the FAILED status)."""
        try:
            config = self._local_config()
        except ModelLoadError as exc:  # the message names the model and what to fix; no traceback
            return self._failed(exc, "failed to load")
        except Exception as exc:  # the cache dir unwritable, ...
            return self._failed(exc, "could not fetch its files", traceback=True)
        self.started_at = time.time()
        started = time.monotonic()
        try:
            caps, rolling = self._start_handler(config)
            dispatcher = self._dispatcher(caps, rolling)
            engine = caps.get_engine() if caps.get_engine is not None else None
            vision = caps.get_vision() if caps.get_vision is not None else None
            kernels = caps.get_kernel_plan() if caps.get_kernel_plan is not None else None
        except (ModelTaskError, ModelLoadError) as exc:  # the message says what to fix; no traceback
            return self._failed(exc, "failed to load")
        except Exception as exc:
            return self._failed(exc, "failed to load", traceback=True)
        elapsed = time.monotonic() - started
        if elapsed > self.config.model_loading_timeout:
            self.error = f"loading took {elapsed:.0f} s, over model_loading_timeout={self.config.model_loading_timeout:g} s"
            self.status = ModelStatus.FAILED
            log.error("Model %s: %s", self.name, self.error)
            return
        self.dispatcher, self.engine, self.rolling_batch, self.vision = dispatcher, engine, rolling, vision
        self.kernels = kernels
        self.capabilities = caps
        if self.observer is not None:
            self.observer.model_loaded(elapsed)
            if engine is not None:
                engine.observe(self.observer)
        self.loaded_at = time.time()
        self.status = ModelStatus.READY
        log.info("Model %s ready (%s, handler %s) in %.1f s", self.name, self.task, caps.module_name, elapsed)

    def _failed(self, exc: Exception, what: str, *, traceback: bool = False) -> None:
        """The FAILED status with the exception's type and message; the log gets a traceback only for
        failures the message alone does not explain."""
        if traceback:
            log.exception("Model %s %s", self.name, what)
        else:
            log.error("Model %s %s: %s", self.name, what, exc)
        self.error, self.status = f"{type(exc).__name__}: {exc}", ModelStatus.FAILED

    def _start_handler(self, config: ModelConfig) -> tuple[HandlerCapabilities, bool]:
        """Decide the task, import the handler and let it load the model: a built-in gets the typed
        config, a model.py DJL's first call with the options. Returns what the handler declares, and
        whether it serves a rolling batch."""
        decision = self.task_decision = decide_task(config)
        log.info("Model %s: task %s (%s)", self.name, decision.task or "none", decision.reason)
        self.task = decision.task
        # A built-in handler refuses a model no task fits, or an encoder-decoder one (check_builtin);
        # a model.py of its own serves it, and is told text-generation (DJL's default) when none fits.
        loaded = resolve_handler(self.name, self.config.model_dir, self.config.entry_point,
                                 decision.task or "text-generation", self.config.handler,
                                 before_builtin=decision.check_builtin)
        self.task = decision.task or "text-generation"
        caps = HandlerCapabilities.read(loaded.module, loaded.function_name, builtin=loaded.builtin,
                                        user_module=loaded.user_module)
        if not self.config.task and caps.serves_tensors:
            self.task = "tensor"  # a model.py declaring its tensors is no text model for /invocations
        rolling = self._resolve_rolling_batch(caps)
        if caps.load is not None:  # a built-in handler: the validated config, typed
            caps.load(config, HandlerContext(
                task=self.task, cache_dir=self.cache_dir, rolling_batch=rolling, user_module=loaded.user_module,
                input_formatter=caps.input_formatter, output_formatter=caps.output_formatter))
        else:
            init = Input(properties={**config.handler_properties(), "task": self.task,
                                     "cache_dir": self.cache_dir, "model_name": self.name,
                                     "rolling_batch": "scheduler" if rolling else "disable"})
            result = caps.handle(init)  # DJL contract: the first call carries the options and no content
            if isinstance(result, Output) and result.failed:
                raise RuntimeError(result.body().decode("utf-8", "replace"))
        return caps, rolling

    def _dispatcher(self, caps: HandlerCapabilities, rolling: bool) -> DynamicBatcher | DirectDispatcher:
        """A rolling batch takes each request on its own thread; anything else goes through the job queue."""
        if rolling:
            return DirectDispatcher(self.name, caps.handle)
        defaults = ENCODER_BATCHING.get(self.task, {}) if caps.builtin and not self.config.enable_streaming else {}
        unset = {field: value for field, value in defaults.items() if field not in self.config.model_fields_set}
        if unset:  # what GET /models/<m> reports too
            log.info("Model %s: dynamic batching %s (unset options of a built-in %s handler)", self.name,
                     ", ".join(f"{k}={v}" for k, v in unset.items()), self.task)
            self.config = self.config.model_copy(update=unset)
        dispatcher = DynamicBatcher(self.name, caps.handle, batch_size=self.config.batch_size,
                                    max_batch_delay_ms=self.config.max_batch_delay,
                                    job_queue_size=self.config.job_queue_size,
                                    predict_timeout=self.config.predict_timeout)
        dispatcher.start()
        return dispatcher

    def _local_config(self) -> ModelConfig:
        """The configuration the handler loads: model_id is the local copy when it names a Hub repo or
        an S3 prefix (downloaded now, once per container), else the configured one."""
        folder = fetch_model_files(self.config, self.cache_dir)
        if folder is None:
            return self.config
        self.model_source = folder
        return self.config.model_copy(update={"model_id": folder})

    @property
    def generates_text(self) -> bool:
        """Whether requests for generated text may come here: text2text-generation (an encoder-
        decoder model) serves every text-generation route too, as it does in DJL LMI."""
        return self.task in GENERATION_TASKS

    def _resolve_rolling_batch(self, caps: HandlerCapabilities) -> bool:
        """`auto` means the rolling batch when the built-in text-generation handler serves the
        model with batch_size 1 and no legacy streaming; `scheduler` insists on it."""
        supported = caps.supports_rolling_batch and self.generates_text
        mode = self.config.rolling_batch
        if mode == "scheduler" and not supported:
            raise ValueError("option.rolling_batch=scheduler needs the built-in text-generation handler; "
                             "a custom handle() receives dynamic batches (use rolling_batch=disable)")
        if mode == "scheduler" and (self.config.batch_size > 1 or self.config.enable_streaming):
            raise ValueError("option.rolling_batch=scheduler cannot be combined with batch_size > 1 or "
                             "option.enable_streaming (both belong to the dynamic-batch path)")
        if mode == "auto":
            return supported and self.config.batch_size == 1 and not self.config.enable_streaming
        return mode == "scheduler"

    def current_status(self) -> ModelStatus:
        """The status, turning a load that outlives model_loading_timeout, or an engine that failed
        (Engine.fail), into a failure."""
        failure = getattr(self.engine, "failure", None)
        if self.status is ModelStatus.READY and failure:
            self.error, self.status = failure, ModelStatus.FAILED
        if (self.status is ModelStatus.LOADING and self.started_at is not None
                and time.time() - self.started_at > self.config.model_loading_timeout):
            self.error = f"still loading after model_loading_timeout={self.config.model_loading_timeout:g} s"
            self.status = ModelStatus.FAILED
        return self.status

    def requested(self) -> None:
        """A request is for this model: every dialect's model lookup ends here or in require_ready."""
        if self.on_request is not None:
            self.on_request(self.name)

    def require_ready(self) -> None:
        """Raise NotReady unless the model is ready; the message says loading or failed (and why)."""
        self.requested()
        if self.current_status() is not ModelStatus.READY or self.dispatcher is None:
            detail = f": {self.error}" if self.error else ""
            raise NotReady(f"Model {self.name} is {self.status.value.lower()}{detail}")

    def rolling_engine(self, routes: str, param: str | None = None):
        """The engine, for routes that drive it directly (`routes` names them in the refusal);
        NotReady before the model is ready, InvalidRequest when it is served with dynamic batching."""
        self.require_ready()
        if self.engine is None and not self.generates_text:  # an embedding model or a classifier
            raise InvalidRequest(f"The model `{self.name}` serves {self.task}, not text generation: {routes} "
                                 "generate text", param=param)
        if self.engine is None:
            raise InvalidRequest(f"The model `{self.name}` is served with dynamic batching; {routes} need the "
                                 "rolling batch (option.rolling_batch=auto or scheduler)", param=param)
        return self.engine

    def submit(self, request: Input) -> Job:
        self.require_ready()
        return self.dispatcher.submit(request)

    def unload(self, grace: float) -> None:
        """Stop serving (the registry no longer lists this model): requests in flight get up to `grace`
        seconds to finish, then the rest end with NotReady ("unloaded"); the threads stop and every
        reference to the handler and its model is dropped, so the memory can go back."""
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and not self._idle():
            time.sleep(0.05)
        reason = f"Model {self.name} was unloaded"
        if self.engine is not None:
            self.engine.stop(reason, NotReady)
        if self.dispatcher is not None:
            self.dispatcher.stop(NotReady(reason))
        self.status, self.error = ModelStatus.FAILED, "unloaded"
        self.dispatcher = self.engine = self.capabilities = self.vision = self.kernels = None

    def _idle(self) -> bool:
        if self.engine is not None:
            stats = self.engine.stats()
            if stats.running or stats.waiting:
                return False
        return self.dispatcher is None or self.dispatcher.idle
