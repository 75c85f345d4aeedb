"""Find the module whose `handle(inputs)` serves a model: a user's model.py or a built-in handler.

Order (as DJL): `option.entryPoint` (a file path, a file in the model dir, or a module name) >
`model.py` in the model dir > the built-in handler for the task. Built-in handlers live in
`serving/handlers/` (package data, so an installed wheel has them) and are loaded exactly like a
user's file, so the two cannot drift.
A user module without the handler function falls back to the built-in one (DJL does the same);
its formatter hooks then reach the built-in through `HandlerContext` (handler_protocol.py).

What a loaded module declares is read once, by `HandlerCapabilities.read` in handler_protocol.py;
no other code looks attributes up on a handler module.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

log = logging.getLogger(__name__)

HANDLERS_DIR = Path(__file__).resolve().parent / "handlers"
BUILTIN_BY_TASK = {"text-generation": "huggingface.py", "text2text-generation": "huggingface.py",
                   "text-embedding": "embeddings.py", "text-classification": "classifier.py"}


class HandlerLoadError(RuntimeError):
    """The handler module is missing or failed to import; the model cannot start."""


def _load_file(path: Path, module_name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise HandlerLoadError(f"cannot load handler file {path}")
    module = importlib.util.module_from_spec(spec)
    # The model dir goes on sys.path so a model.py can import its sibling files.
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # a syntax or import error in user code must stop this model's start
        raise HandlerLoadError(f"{path}: {type(exc).__name__}: {exc}") from exc
    finally:
        sys.path.remove(str(path.parent))
    return module


def builtin_handler_path(task: str) -> Path:
    try:
        return HANDLERS_DIR / BUILTIN_BY_TASK[task]
    except KeyError:
        raise HandlerLoadError(f"no built-in handler for task {task!r}; supported: {sorted(BUILTIN_BY_TASK)}") from None


@dataclass(frozen=True)
class LoadedHandler:
    """The module serving one model, and how it was found."""

    module: ModuleType
    function_name: str  # the entry point's name in `module` (option.handler; `handle` for a built-in)
    builtin: bool  # one of serving/handlers/*.py, which receives the typed config (handler_protocol.py)
    user_module: ModuleType | None = None  # the model.py a built-in serves (formatter hooks), if any


def resolve_handler(model_name: str, model_dir: str | None, entry_point: str | None, task: str,
                    function_name: str = "handle",
                    before_builtin: Callable[[], None] | None = None) -> LoadedHandler:
    """Import the module serving one model. Each model gets its own module object, so module-level
    state in a handler is per model. `before_builtin` runs just before a built-in handler would be
    loaded, and may raise to refuse it (the task decision does, for a model no built-in serves)."""
    unique = f"lmi_serve_model_{model_name.replace('-', '_').replace('.', '_')}"
    user_module = None
    if entry_point:
        candidate = Path(entry_point) if Path(entry_point).is_absolute() or not model_dir else Path(model_dir) / entry_point
        if candidate.suffix == ".py" and candidate.is_file():
            user_module = _load_file(candidate, unique)
        elif entry_point.endswith(".py"):
            raise HandlerLoadError(f"option.entryPoint: file {candidate} not found")
        else:
            try:
                user_module = importlib.import_module(entry_point)
            except Exception as exc:
                raise HandlerLoadError(f"option.entryPoint: cannot import {entry_point!r}: {exc}") from exc
    elif model_dir and (Path(model_dir) / "model.py").is_file():
        user_module = _load_file(Path(model_dir) / "model.py", unique)

    if user_module is not None:
        fn = getattr(user_module, function_name, None)
        if callable(fn):
            return LoadedHandler(user_module, function_name, builtin=False)
        log.warning("%s: %s defines no %s(); using the built-in %s handler",
                    model_name, user_module.__name__, function_name, task)
    if before_builtin is not None:
        before_builtin()
    builtin = _load_file(builtin_handler_path(task), unique + "_builtin")
    # Formatter hooks in a model.py still apply when the built-in handler serves it.
    return LoadedHandler(builtin, "handle", builtin=True, user_module=user_module)


def load_handler(model_name: str, model_dir: str | None, entry_point: str | None, task: str,
                 function_name: str = "handle") -> tuple[ModuleType, Callable]:
    """(module, handle function) for one model, for code driving a handler through DJL's contract
    alone (its first `handle()` call carries the string properties)."""
    loaded = resolve_handler(model_name, model_dir, entry_point, task, function_name)
    return loaded.module, getattr(loaded.module, loaded.function_name)
