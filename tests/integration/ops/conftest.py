"""One server for the ops modules that each need one non-default setting: test_access_log.py (JSON
logs, LMI_SERVE_LOG_FORMAT=json) and test_body_scan.py (a 4 MiB body limit, LMI_SERVE_MAX_REQUEST_BYTES);
test_bounded_echoes.py needs the limit (its bodies are ~2 MB) and reads only how much the log grows.
None depends on another's setting being absent: the access log's requests are small, and the body
probes only read status codes, timings and memory, never the log.

The store is the whole embedded default store: loading MiniLM's checkpoint makes transformers warn
("`torch_dtype` is deprecated!"), which must come out as JSON too (server/logs.py route_library_logs),
and the access log's every-line-is-JSON check reads it."""

from __future__ import annotations

import pytest

from server_process import serving

MAX_REQUEST_BYTES = 4 * 1024 * 1024  # test_body_scan.py's LIMIT


@pytest.fixture(scope="package")
def json_logs_small_body_server():
    """The default store with JSON logs and a 4 MiB body limit: shared by test_access_log.py and
    test_body_scan.py, one start (~9 s) instead of two."""
    with serving(env={"LMI_SERVE_LOG_FORMAT": "json", "LMI_SERVE_MAX_REQUEST_BYTES": str(MAX_REQUEST_BYTES)}) as server:
        yield server
