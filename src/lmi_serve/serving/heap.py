"""Python's cyclic garbage collector in a serving worker: what loading made is frozen out of its reach.

A worker with SmolLM2 loaded tracks ~490k objects (the model's modules and tensors, transformers, the
tokenizer, Flask); a full collection walks every one, 230-270 ms with the GIL held, during which no stream
gets a token. Python runs one once enough objects have survived into its oldest generation: in a served
32-stream run, none in its first three minutes, then one of 250 ms (benchmarks/journal/2026-11.md). Objects that
live as long as the model need no collector, so after loading `settle` collects once and freezes everything
alive (`gc.freeze`): the next full collection took 0.0 ms. Unloading a model (multi-model endpoints) thaws
first (`collect`), so the cycles the model leaves are collected, then freezes what survives.

Only a serving worker turns this on (`freeze_after_loads`, server/app.py): a process that merely imports
lmi-serve (a test, a benchmark) keeps Python's usual collector. What a request in flight holds when a model
finishes loading is frozen with the rest; its cycles, if it makes any, are not collected: at most one
request's worth per load.
"""

from __future__ import annotations

import gc
import logging
import threading

log = logging.getLogger(__name__)

_lock = threading.Lock()
_on = {"freeze": False}


def freeze_after_loads() -> None:
    """This process is a serving worker: `settle` and `collect` freeze from now on."""
    _on["freeze"] = True


def settle() -> None:
    """After a model has loaded: collect once, then freeze everything alive (in a serving worker)."""
    if not _on["freeze"]:
        return
    with _lock:
        gc.collect()
        gc.freeze()
        frozen = gc.get_freeze_count()
    log.info("Python's collector: %d objects frozen after loading (a full collection no longer walks them)", frozen)


def collect() -> None:
    """Collect every reference cycle, frozen or not (a model was unloaded), then freeze the survivors again
    (in a serving worker; elsewhere a plain collection)."""
    with _lock:
        if not _on["freeze"]:
            gc.collect()
            return
        gc.unfreeze()
        gc.collect()
        gc.freeze()
