"""The largest accepted bodies, sent to each dialect's main route while a token stream runs on the
same worker: one long string, nesting just under and just over the route's depth limit, many keys.
Each is answered in the route's dialect (never a 5xx), the stream keeps producing tokens, /ping
keeps answering, and the worker's memory grows by a bounded multiple of the body.

The body limit is 4 MiB here to keep the test quick; what it checks is the per-byte cost. The
string-stripping regex this replaced took ~120 bytes of memory and ~150 ns with the GIL held per
byte of a string, and scanned /v2/repository/index's body five times: at 4 MiB that is ~480 MiB
(over MAX_GROWTH) and seconds of /ping stall on that route.
The bounds are generous, not 1 s, because this 2-core machine is shared: /ping, which waits only
for the GIL, stayed under 0.1 s for a 16 MiB string but the stream's largest gap, which also waits
for CPU (torch's threads), reached 0.7-0.9 s with a 1 KB body and up to 4 s with a 16 MiB one the
server refused in 0.8 s, under a load average of 5.
"""

from __future__ import annotations

import pytest

from benchmarks.benchmark.body_probe import ROUTES, SHAPES, probe, worker_process

pytestmark = pytest.mark.integration

LIMIT = 4 * 1024 * 1024
SIZE = LIMIT - 1  # the largest body the server accepts
MAX_PING = 3.0  # seconds: the slowest /ping while a body is handled
MAX_GAP = 6.0  # seconds: the stream's largest inter-token gap meanwhile
MAX_GROWTH = 24 * SIZE + 64 * 2**20  # many small keys cost ~15 bytes of Python objects per byte of JSON
DEPTH_REFUSALS = {"triton": "JSON nesting depth exceeds maximum allowed limit", "other": "levels deep; at most"}


@pytest.fixture(scope="module")
def server(json_logs_small_body_server):
    """SmolLM2 and `simple` (the routes' models, from the default store) with
    LMI_SERVE_MAX_REQUEST_BYTES=LIMIT, shared with test_access_log.py (conftest.py; its JSON logs
    change nothing here)."""
    assert int(json_logs_small_body_server.env["LMI_SERVE_MAX_REQUEST_BYTES"]) == LIMIT
    return json_logs_small_body_server


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("route", list(ROUTES))
def test_a_largest_body_leaves_the_worker_serving(server, route, shape):
    found = probe(server.base, worker_process(server.proc.pid), route, shape, SIZE)
    assert 200 <= found.status < 500, found
    refusal = DEPTH_REFUSALS["triton" if route.startswith("/v2/") else "other"]
    assert (refusal in found.error) is (shape == "deep_over"), found
    assert found.stream_gap < MAX_GAP, found
    assert found.ping_max < MAX_PING, found
    assert found.rss_growth < MAX_GROWTH, found
