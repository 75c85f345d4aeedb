"""Property-based fuzzing of every POST route of the five dialects against the real default server.

For each route, a fixed catalog of hostile requests (one test each: NaN/Infinity/1e309, 2**63,
lone surrogates, invalid UTF-8, 1,000 and 5,000 levels of nesting, every field with a wrong type or
missing, empty/non-JSON/oversized bodies, Content-Type, Content-Encoding, Triton's
Inference-Header-Content-Length), then hypothesis sends requests built from the route's real schema
and mutated (tests/fuzz_strategies.py), derandomized so CI sees the same requests every run.
Every answer must hold, whatever was sent:
- no 5xx except the few the docs document for load (ALLOWED_5XX below);
- JSON, never an HTML page: a whole body parses as JSON; a stream that answered 200 is well-formed
  SSE or JSON lines whose every frame is JSON (an error inside a started stream is a JSON frame);
- an error (>= 400) in the shape of the route's dialect (`assert_error_shape`);
and after each route's examples the server is healthy (/ping) and still serves a good request of
each dialect. Malformed HTTP over a raw socket must be answered with a JSON 4xx too.
"""

from __future__ import annotations

import json
import socket
import time

import pytest
import requests
from hypothesis import HealthCheck, Phase, given, settings

from fuzz_strategies import EMBEDDING_MODEL, ROUTES, TENSOR_MODEL, TEXT_MODEL, Case, Route, catalog, requests_for

pytestmark = pytest.mark.integration

TIMEOUT = 60  # seconds for one request (connect and each read): a request that never answers fails
# The only 5xx statuses a client can be given for any input, each documented in docs/.
ALLOWED_5XX = {
    503: "waiting queue full or model loading (docs/lmi.md, Errors; Triton: not ready / queue full)",
    504: "waited longer than predict_timeout (docs/lmi.md, Errors)",
    507: "out of memory in a handler (docs/lmi.md, Errors)",
}
ANTHROPIC_ALLOWED_5XX = {529: "waiting queue full, Anthropic's overloaded_error (docs/anthropic.md, Errors)"}
TRITON_ALLOWED_5XX = {501: "unsupported Content-Encoding on /infer (docs/triton.md: 501 Unsupported compression type)"}
# Examples per route: generation routes cost a prefill and two tokens for each accepted request.
EXAMPLES = {"cheap": 100, "generation": 30}  # 30: fourteen generation routes now, each example a prefill and tokens
GENERATION = {"/invocations", f"/predictions/{TEXT_MODEL}", "/", "/generate", "/generate_stream",
              "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
              f"/v2/models/{TEXT_MODEL}/versions/1/infer", f"/v2/models/{TEXT_MODEL}/generate",
              f"/v2/models/{TEXT_MODEL}/generate_stream"}


def _strict_json(data: bytes | str):
    """json.loads that also refuses NaN/Infinity, which are not JSON."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(data, parse_constant=refuse)


def _server_tail(server, lines: int = 25) -> str:
    return "\n".join(server.output().splitlines()[-lines:])


def send(server, route: Route, case: Case) -> requests.Response:
    try:
        return requests.post(server.url(route.path), data=case.body, headers=case.headers, timeout=TIMEOUT)
    except requests.Timeout:
        pytest.fail(f"POST {route.path} got no answer within {TIMEOUT} s for {case!r}\n"
                    f"server log tail:\n{_server_tail(server)}")
    except requests.ConnectionError as exc:
        pytest.fail(f"POST {route.path} lost the connection ({exc}) for {case!r}\n"
                    f"server log tail:\n{_server_tail(server)}")


# --- what every answer must look like ----------------------------------------------------------

def assert_error_shape(dialect: str, status: int, body) -> None:
    """The error body of `dialect` (shapes from docs/ and /work/shared/reference)."""
    assert isinstance(body, dict), f"error body is not a JSON object: {body!r}"
    if dialect == "openai":
        error = body.get("error")
        assert isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error), \
            f"not OpenAI's {{'error': {{message, type, param, code}}}}: {body!r}"
        assert isinstance(error["message"], str) and isinstance(error["type"], str), body
    elif dialect == "tgi":
        assert isinstance(body.get("error"), str) and isinstance(body.get("error_type"), str), \
            f"not TGI's {{'error', 'error_type'}}: {body!r}"
    elif dialect == "triton":
        assert set(body) == {"error"} and isinstance(body["error"], str), f"not Triton's {{'error': str}}: {body!r}"
    elif dialect == "anthropic":
        error = body.get("error")
        assert body.get("type") == "error" and isinstance(error, dict) and set(error) == {"type", "message"}, \
            f"not Anthropic's {{'type': 'error', 'error': {{type, message}}}}: {body!r}"
        assert isinstance(error["type"], str) and isinstance(error["message"], str), body
    else:  # LMI: a handler's failure {"code", "message", "error"} (any code a handler chooses: 424 by
        # default, 507 out of memory, 400 from a tensor model's get_tensors); the server's own errors
        # {"code", "type", "message"} (with "error" too since issue 9)
        assert body.get("code") == status, f"LMI error without code == {status}: {body!r}"
        if "type" not in body:
            assert isinstance(body.get("error"), str), f"LMI handler failure without 'error': {body!r}"
        else:
            assert isinstance(body.get("type"), str) and isinstance(body.get("message"), str), \
                f"not LMI's {{'code', 'type', 'message'}}: {body!r}"


def _sse_frames(text: str) -> list[str]:
    """The data payloads of an SSE body; every non-blank line must be a field of the protocol."""
    frames = []
    for event in text.replace("\r\n", "\n").split("\n\n"):
        data = []
        for line in event.split("\n"):
            if not line or line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            assert name in ("data", "event", "id", "retry"), f"not an SSE line: {line!r}"
            if name == "data":
                data.append(value[1:] if value.startswith(" ") else value)
        if data:
            frames.append("\n".join(data))
    return frames


def assert_stream_frames(dialect: str, content_type: str, text: str) -> None:
    if content_type.startswith("text/event-stream"):
        frames = [f for f in _sse_frames(text) if not (dialect in ("openai", "lmi") and f == "[DONE]")]
    else:
        frames = [line for line in text.split("\n") if line.strip()]
    assert frames, f"a 200 stream without a single frame: {text!r}"
    for frame in frames:
        try:
            value = _strict_json(frame)
        except ValueError as exc:
            raise AssertionError(f"stream frame is not JSON ({exc}): {frame!r}") from None
        if isinstance(value, dict) and "error" in value and dialect in ("openai", "tgi", "triton"):
            if dialect != "openai" or isinstance(value["error"], dict):
                assert_error_shape(dialect, 500, value)
        if dialect == "anthropic":  # every event names its type; an `error` event is the error object
            assert isinstance(value, dict) and isinstance(value.get("type"), str), f"not an Anthropic event: {frame!r}"
            if value["type"] == "error":
                assert_error_shape(dialect, 500, value)


def assert_binary_infer(response: requests.Response) -> None:
    """Triton binary outputs: a JSON header of Inference-Header-Content-Length bytes, then data."""
    length = response.headers.get("Inference-Header-Content-Length")
    assert length is not None and length.isdigit(), f"binary answer without a valid header length: {length!r}"
    _strict_json(response.content[:int(length)])


def check_answer(server, route: Route, case: Case, response: requests.Response) -> None:
    status, content_type = response.status_code, response.headers.get("Content-Type", "")
    allowed = {**ALLOWED_5XX, **(TRITON_ALLOWED_5XX if route.dialect == "triton" else {}),
               **(ANTHROPIC_ALLOWED_5XX if route.dialect == "anthropic" else {})}
    assert status < 500 or status in allowed, (
        f"POST {route.path} answered {status} to {case!r}: {response.text[:500]!r}\n"
        f"server log tail:\n{_server_tail(server)}")
    assert "html" not in content_type.lower() and not response.text.lstrip().startswith("<"), (
        f"POST {route.path} answered HTML ({status}, {content_type}) to {case!r}: {response.text[:300]!r}")
    if status == 200 and route.streams and content_type.startswith(("text/event-stream", "application/jsonlines")):
        try:
            text = response.content.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise AssertionError(f"POST {route.path}: a stream that is not UTF-8 ({exc}) for {case!r}") from None
        assert_stream_frames(route.dialect, content_type, text)
        return
    if status == 200 and content_type.startswith("application/octet-stream"):
        assert_binary_infer(response)
        return
    try:
        body = _strict_json(response.content)
    except ValueError as exc:
        raise AssertionError(f"POST {route.path} answered {status} ({content_type}) with a body that is not JSON "
                             f"({exc}) to {case!r}: {response.content[:300]!r}") from None
    if status >= 400:
        try:
            assert_error_shape(route.dialect, status, body)
        except AssertionError as exc:
            raise AssertionError(f"POST {route.path} answered {status} to {case!r}: {exc}") from None


def assert_healthy(server) -> None:
    response = requests.get(server.url("/ping"), timeout=TIMEOUT)
    assert response.status_code == 200, f"/ping {response.status_code}: {response.text}\n{_server_tail(server)}"
    assert all(entry["status"] == "Healthy" for entry in response.json().values()), response.text


# --- the fuzz tests ----------------------------------------------------------------------------

CATALOG = [(route, case) for route in ROUTES for case in catalog(route)]


@pytest.mark.parametrize(("route", "case"), CATALOG, ids=[f"{r.path} {c.note}" for r, c in CATALOG])
def test_catalog_of_hostile_requests(default_server, route: Route, case: Case):
    # The inputs every route must survive (fuzz_strategies.catalog), one test each so that every
    # failure is reported; hypothesis then explores around them (below).
    check_answer(default_server, route, case, send(default_server, route, case))


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.id)
def test_fuzzed_requests_get_json_answers_in_the_dialect_shape(default_server, route: Route):
    examples = EXAMPLES["generation" if route.path in GENERATION else "cheap"]

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None, print_blob=False,
              phases=(Phase.generate, Phase.shrink),
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.large_base_example])
    @given(case=requests_for(route))
    def fuzz(case: Case) -> None:
        check_answer(default_server, route, case, send(default_server, route, case))

    fuzz()
    assert_healthy(default_server)


GOOD = [
    ("/invocations", {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}, "generated_text"),
    ("/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}, "generated_text"),
    ("/v1/completions", {"model": TEXT_MODEL, "prompt": "Hello", "max_tokens": 2}, "choices"),
    ("/v1/responses", {"model": TEXT_MODEL, "input": "Hello", "max_output_tokens": 2}, "output"),
    ("/v1/messages", {"model": TEXT_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}, "content"),
    ("/v1/embeddings", {"model": EMBEDDING_MODEL, "input": "a cat"}, "data"),
    (f"/v2/models/{TEXT_MODEL}/generate", {"text_input": "Hello", "max_tokens": 2}, "text_output"),
    (f"/v2/models/{TENSOR_MODEL}/generate", {"INPUT0": list(range(16)), "INPUT1": [1] * 16}, "OUTPUT0"),
]


@pytest.mark.parametrize(("path", "body", "key"), GOOD, ids=[g[0] for g in GOOD])
def test_still_serving_after_the_fuzzing(default_server, path, body, key):
    # Runs after the fuzz tests (file order): each dialect still answers a good request.
    response = requests.post(default_server.url(path), json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    assert key in response.json(), response.text
    assert_healthy(default_server)


# Unknown routes and wrong methods, in each dialect's shape; outside the dialect prefixes LMI's
# {"code", "type", "message"} also carries "error" (as DJL's and the other dialects' bodies do).
ROUTING = [("POST", "/no-such-route", 404, "lmi"), ("GET", "/invocations", 405, "lmi"),
           ("PUT", f"/predictions/{TEXT_MODEL}", 405, "lmi"), ("POST", "/predictions/no-such-model", 404, "lmi"),
           ("GET", "/generate_stream", 405, "tgi"), ("POST", "/generate/extra", 404, "tgi"),
           ("GET", "/v1/completions", 405, "openai"), ("POST", "/v1/no-such-route", 404, "openai"),
           ("PUT", "/v1/responses", 405, "openai"), ("GET", "/v1/responses/resp_none", 404, "openai"),
           ("DELETE", "/v1/responses/%ff%00", 404, "openai"),
           ("POST", "/v1/completions?x=%ff", None, "openai"),
           ("GET", "/v1/messages", 405, "anthropic"), ("POST", "/v1/messages/batches", 404, "anthropic"),
           ("GET", f"/v2/models/{TENSOR_MODEL}/infer", 405, "triton"), ("POST", "/v2/no-such-route", 404, "triton"),
           ("POST", "/v2/models/no-such-model/infer", 404, "triton"),
           ("POST", "/metrics", 405, "lmi"), ("DELETE", "/metrics", 405, "lmi")]


@pytest.mark.parametrize(("method", "path", "status", "dialect"), ROUTING, ids=[f"{r[0]} {r[1]}" for r in ROUTING])
def test_routing_errors_in_the_dialect_shape(default_server, method, path, status, dialect):
    response = requests.request(method, default_server.url(path), data=b"{}", timeout=TIMEOUT)
    assert 400 <= response.status_code < 500 and response.status_code == (status or response.status_code), \
        f"{method} {path}: {response.status_code} {response.text!r}"
    body = _strict_json(response.content)
    assert_error_shape(dialect, response.status_code, body)
    if dialect == "lmi" and response.status_code in (404, 405) and not path.startswith("/predictions/"):
        assert isinstance(body.get("error"), str), f"{method} {path}: no 'error' in {body!r}"


# /metrics takes no input: whatever comes with a GET (a query, a body, odd headers) is ignored and
# the answer is the Prometheus text; other methods are routing errors (ROUTING above).
METRICS_GETS = [("?name[]=%ff&x=\ud800", b"", {}), ("", b"\xff\x00{" * 1000, {"Content-Type": "application/json"}),
                ("", b"", {"Accept": "application/openmetrics-text; version=9", "Accept-Encoding": "gzip, br"}),
                ("?" + "a=1&" * 500, b"", {"Content-Encoding": "gzip"})]


@pytest.mark.parametrize(("query", "body", "headers"), METRICS_GETS, ids=range(len(METRICS_GETS)))
def test_metrics_ignores_what_comes_with_a_get(default_server, query, body, headers):
    from prometheus_client.parser import text_string_to_metric_families

    response = requests.get(default_server.url("/metrics" + query), data=body, headers=headers, timeout=TIMEOUT)
    assert response.status_code == 200, response.text[:300]
    assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    names = {family.name for family in text_string_to_metric_families(response.text)}
    assert "lmi_serve:http_requests" in names, sorted(names)


# --- malformed HTTP over a raw socket ----------------------------------------------------------

def _raw_request(server, head: bytes, body: bytes = b"") -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as sock:
        sock.sendall(head + b"\r\n\r\n" + body)
        chunks = []
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            except TimeoutError:
                pytest.fail(f"no answer within {TIMEOUT} s to {head!r}")
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


BODY = b'{"inputs": "Hello", "parameters": {"max_new_tokens": 2}}'


def _head(path: str, *headers: bytes) -> bytes:
    return b"\r\n".join([b"POST %s HTTP/1.1" % path.encode(), b"Host: x", *headers, b"Connection: close"])


LENGTH = b"Content-Length: %d" % len(BODY)
MALFORMED = {
    "negative Content-Length": _head("/invocations", b"Content-Length: -1"),
    "non-numeric Content-Length": _head("/invocations", b"Content-Length: ten"),
    "two Content-Lengths": _head("/invocations", b"Content-Length: 5", b"Content-Length: 7"),
    "NUL in a header value": _head("/invocations", b"X-Test: a\x00b", LENGTH),
    "CR in a header value": _head("/v1/completions", b"X-Test: a\rb", LENGTH),
    "bare LF in a header value": _head("/v1/chat/completions", b"X-Test: a\nb", LENGTH),
    "folded header line": _head("/generate", b"X-Test: a", b" b", LENGTH),
    "header without a colon": _head("/v2/models/simple/infer", b"NoColonHere", LENGTH),
    "bad chunk size": _head("/invocations", b"Transfer-Encoding: chunked"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_http_gets_a_json_4xx(default_server, name):
    body = b"zz\r\n" + BODY + b"\r\n0\r\n\r\n" if name == "bad chunk size" else BODY
    answer = _raw_request(default_server, MALFORMED[name], body)
    assert answer.startswith(b"HTTP/1."), f"{name}: no HTTP answer at all: {answer[:300]!r}"
    head, _, payload = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert 400 <= status < 500, f"{name}: status {status}: {answer[:500]!r}"
    assert b"html" not in head.lower() and not payload.lstrip().startswith(b"<"), f"{name}: HTML answer: {answer!r}"
    try:
        _strict_json(payload)
    except ValueError as exc:
        raise AssertionError(f"{name}: the body is not JSON ({exc}): {answer[:500]!r}") from None
    assert_healthy(default_server)
