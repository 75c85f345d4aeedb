"""A client that closes its connection while a whole (non-streamed) response is being generated
frees its engine rows, on every dialect's non-streaming generation route (and a Responses stream whose
client never reads it); the server serves on.

Each request asks for far more tokens than the test waits for, ignoring EOS; the client sends it on
a raw socket, waits until its rows run, and closes the connection. The engine's step counter proves
the rows were dropped, not finished: running to the end takes at least MAX_TOKENS steps."""

from __future__ import annotations

import json
import socket

import pytest
import requests

from server_process import wait_for

pytestmark = pytest.mark.integration

LLM = "smollm2-135m-instruct"
PROMPT = "Write a long story about a dragon."
MAX_TOKENS = 2000  # minutes on a CPU if never cancelled
CHAT = [{"role": "user", "content": PROMPT}]


def lmi(tokens):
    return {"inputs": PROMPT, "parameters": {"max_new_tokens": tokens, "ignore_eos_token": True}}


def lmi_chat(tokens):
    return {"messages": CHAT, "max_tokens": tokens, "ignore_eos": True}


def tgi(tokens):
    return {"inputs": PROMPT, "parameters": {"max_new_tokens": tokens, "ignore_eos_token": True}}


def completions(tokens, **extra):
    return {"model": LLM, "prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True, "stream": False, **extra}


def chat_completions(tokens):
    return {"model": LLM, "messages": CHAT, "max_tokens": tokens, "ignore_eos": True, "stream": False, "n": 2}


def responses(tokens, **extra):
    return {"model": LLM, "input": PROMPT, "max_output_tokens": tokens, "ignore_eos": True, **extra}


def triton_generate(tokens):
    return {"text_input": PROMPT, "max_tokens": tokens, "sampling_parameters": json.dumps({"ignore_eos": True})}


def triton_infer(tokens):
    return {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [PROMPT]},
                       {"name": "max_tokens", "shape": [1], "datatype": "INT32", "data": [tokens]}],
            "parameters": {"ignore_eos": True}}


# (path, body for a number of tokens, engine rows the request takes)
ROUTES = {
    "lmi-invocations": ("/invocations", lmi, 1),
    "lmi-invocations-chat": ("/invocations", lmi_chat, 1),
    "tgi-root": ("/", tgi, 1),
    "tgi-generate": ("/generate", tgi, 1),
    "openai-completions-n2": ("/v1/completions", lambda t: completions(t, n=2), 2),
    "openai-completions-best-of": ("/v1/completions", lambda t: completions(t, best_of=3), 3),
    "openai-chat-n2": ("/v1/chat/completions", chat_completions, 2),
    "openai-responses": ("/v1/responses", responses, 1),
    "openai-responses-stream": ("/v1/responses", lambda t: responses(t, stream=True), 1),  # events never read
    "triton-generate": (f"/v2/models/{LLM}/generate", triton_generate, 1),
    "triton-infer": (f"/v2/models/{LLM}/infer", triton_infer, 1),
}


def engine_stats(server):
    return requests.get(server.url(f"/models/{LLM}"), timeout=10).json()[0]["models"][0]["engine"]


def send(server, path: str, body: dict) -> socket.socket:
    """POST on a raw socket; the caller closes it without reading the answer."""
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n")
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(head.encode() + data)
    return sock


@pytest.mark.parametrize("route", list(ROUTES))
def test_closing_the_connection_frees_the_rows(default_server, route):
    path, body, rows = ROUTES[route]
    wait_for(lambda: engine_stats(default_server)["running"] == 0, timeout=120)  # nothing left from before
    steps_before = engine_stats(default_server)["steps"]
    sock = send(default_server, path, body(MAX_TOKENS))
    try:
        wait_for(lambda: engine_stats(default_server)["running"] >= rows, timeout=120)
    finally:
        sock.close()
    wait_for(lambda: engine_stats(default_server)["running"] == 0, timeout=120)
    assert engine_stats(default_server)["steps"] - steps_before < MAX_TOKENS  # dropped, not finished
    served = requests.post(default_server.url(path), json=body(3), timeout=120)
    assert served.status_code == 200, served.text


def test_a_client_still_connected_gets_its_whole_answer(default_server):
    """The watch never mistakes a waiting client for a gone one (keep-alive, two requests in a row)."""
    with requests.Session() as session:
        for _ in range(2):
            response = session.post(default_server.url("/generate"), json=tgi(20), timeout=120)
            assert response.status_code == 200 and response.json()["generated_text"]
