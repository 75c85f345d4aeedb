"""serving/heap.py: a serving worker freezes what loading made out of the collector's walks, an unload
still collects the cycles a model leaves, and a process that only imports lmi-serve freezes nothing."""

from __future__ import annotations

import gc
import time
import weakref

import pytest

from lmi_serve.serving import heap
from lmi_serve.serving.registry import ModelRegistry


class _Cycle:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self):
        self.me = self


@pytest.fixture
def worker():
    """heap switched on as in a serving worker; the process thawed and switched back afterwards."""
    heap.freeze_after_loads()
    yield
    heap._on["freeze"] = False
    gc.unfreeze()


def test_settle_freezes_what_is_alive_and_collect_still_frees_a_frozen_cycle(worker):
    model_part = _Cycle()
    alive = weakref.ref(model_part)
    heap.settle()
    assert gc.get_freeze_count() > 0
    del model_part
    gc.collect()
    assert alive() is not None  # frozen: a full collection no longer walks it
    heap.collect()  # what an unload runs
    assert alive() is None
    assert gc.get_freeze_count() > 0  # the survivors are frozen again


def test_outside_a_worker_nothing_is_frozen():
    assert not heap._on["freeze"]
    before = gc.get_freeze_count()
    heap.settle()
    assert gc.get_freeze_count() == before
    garbage = _Cycle()
    alive = weakref.ref(garbage)
    del garbage
    heap.collect()
    assert alive() is None


class _Service:
    def __init__(self, name: str, loads: list):
        self.name, self.loads = name, loads

    def load(self) -> None:
        self.loads.append((self.name, gc.get_freeze_count()))


def test_the_registry_settles_once_every_model_has_loaded(worker, monkeypatch):
    loads: list = []
    frozen_before = gc.get_freeze_count()
    registry = ModelRegistry([_Service("a", loads), _Service("b", loads)])
    settled = []
    original = heap.settle

    def settle() -> None:
        loaded = [name for name, _ in loads]
        original()
        settled.append(loaded)

    monkeypatch.setattr(heap, "settle", settle)
    registry.start_loading()
    deadline = time.monotonic() + 30
    while not settled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert settled == [["a", "b"]]
    assert [frozen for _, frozen in loads] == [frozen_before, frozen_before]  # nothing frozen mid-load
    assert gc.get_freeze_count() > frozen_before
