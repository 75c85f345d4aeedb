"""One server for two ops modules that each need one non-default setting: test_access_log.py (JSON
logs, LMI_SERVE_LOG_FORMAT=json) and test_body_scan.py (a 4 MiB body limit, LMI_SERVE_MAX_REQUEST_BYTES).
Neither depends on the other's setting being absent: the access log's requests are small, and the body
probes only read status codes, timings and memory, never the log.

The store is the two embedded defaults the modules use, SmolLM2 (both) and `simple` (the body probes'
Triton tensor route), not the whole default store: loading MiniLM's checkpoint prints transformers'
"`torch_dtype` is deprecated!" as a plain-text line, which the access log's every-line-is-JSON check
would read."""

from __future__ import annotations

import shutil

import pytest

from lmi_serve.__main__ import DEFAULT_STORE
from server_process import serving

MAX_REQUEST_BYTES = 4 * 1024 * 1024  # test_body_scan.py's LIMIT
MODELS = ("smollm2-135m-instruct", "simple")  # folders of the embedded default store


@pytest.fixture(scope="package")
def json_logs_small_body_server(tmp_path_factory):
    """SmolLM2 and `simple` with JSON logs and a 4 MiB body limit: shared by test_access_log.py and
    test_body_scan.py, one start (~9 s) instead of two."""
    store = tmp_path_factory.mktemp("ops-store")
    for name in MODELS:
        shutil.copytree(DEFAULT_STORE / name, store / name)
    with serving("--model-store", str(store),
                 env={"LMI_SERVE_LOG_FORMAT": "json", "LMI_SERVE_MAX_REQUEST_BYTES": str(MAX_REQUEST_BYTES)}) as server:
        yield server
