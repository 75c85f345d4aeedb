"""Waiting on the engine from a test without hanging the suite when something is broken."""

from __future__ import annotations

import threading

import pytest

WAIT = 60.0  # generous: only reached when something is broken


def within(fn, timeout: float = WAIT):
    """fn() in a helper thread: its result or its exception, or a failure after `timeout`."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        pytest.fail(f"no answer within {timeout} s")
    if "error" in box:
        raise box["error"]
    return box["value"]
