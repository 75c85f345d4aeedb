"""memory.py: the heap is trimmed once per idle period that follows work, never while busy."""

from __future__ import annotations

import ctypes

import pytest

from lmi_serve.engine import memory
from lmi_serve.engine.memory import IdleTrim


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def trims():
    return []


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def idle(trims, clock):
    return IdleTrim(idle_seconds=1.0, clock=clock, trimmer=lambda: trims.append(clock.now) or True)


def test_never_trims_while_busy_or_before_the_idle_delay(idle, clock, trims):
    for t in range(10):
        clock.now = t / 2
        assert not idle.tick(busy=True)
    clock.now += 0.9
    assert not idle.tick(busy=False)
    assert trims == []


def test_trims_once_per_idle_period_after_work(idle, clock, trims):
    idle.tick(busy=True)
    clock.now = 1.0
    assert idle.tick(busy=False)
    for t in (1.5, 3.0, 10.0):  # idle on: nothing new to give back
        clock.now = t
        assert not idle.tick(busy=False)
    idle.tick(busy=True)  # work again, then idle again: one more trim
    clock.now = 11.5
    assert idle.tick(busy=False)
    assert trims == [1.0, 11.5]


def test_nothing_to_trim_at_start(idle, clock, trims):
    clock.now = 5.0
    assert not idle.tick(busy=False)
    assert trims == []


@pytest.mark.skipif(memory._malloc_trim is None, reason="malloc_trim is glibc's")
def test_trim_gives_freed_heap_pages_back():
    # Many small blocks (under the mmap threshold) come from the heap; freed, they stay in the
    # process until trimmed. Resident anonymous memory must drop by most of them after trim().
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    memory.trim()
    size, count = 64 * 1024, 2048  # 128 MiB in 64 KiB blocks
    blocks = [libc.malloc(size) for _ in range(count)]
    for block in blocks:
        ctypes.memset(block, 1, size)  # touch: resident
    keep = libc.malloc(size)  # above the others, so the heap cannot simply shrink from its top
    ctypes.memset(keep, 1, size)
    for block in blocks:
        libc.free(block)
    before = _rss_anon_mib()
    assert memory.trim()
    after = _rss_anon_mib()
    libc.free(keep)
    assert before - after > 64, f"RssAnon {before:.0f} -> {after:.0f} MiB"


def _rss_anon_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon in /proc/self/status")
