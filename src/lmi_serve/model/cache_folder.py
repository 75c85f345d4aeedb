"""A folder the server builds once into its cache (a GGUF converted to safetensors, a pre-quantized
checkpoint dequantized): a lock beside it makes concurrent starts (gunicorn workers, containers sharing
the cache) wait for one build; the folder appears whole, renamed from `<target>.partial`, so a start that
finds its config.json finds it complete and builds nothing."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path


def built_once(target: Path, build: Callable[[Path], None]) -> Path:
    """`target`, written by `build(staging)` into an empty staging folder the first time it is asked for."""
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").exists():  # built by another start while this one waited
            return target
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        build(staging)
        os.replace(staging, target)
    return target
