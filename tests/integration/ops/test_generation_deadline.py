"""option.generation_deadline on every dialect: a request still generating at its deadline ends with what it
has, as at its token limit in the dialect's words, whole responses carry X-LMI-Deadline-Exceeded (and
SageMaker's custom attribute), streams end cleanly with the finish reason, and /metrics and the access log
record it.

The tiny-model server's `tiny-deadline` (tests/tiny_store.py) is the reasoner's random weights with a 1 s
deadline; asked for 4,000 tokens, which it would take a minute to write, every request is cut. All the
requests run at once (one batch, so the module costs about one deadline), with a greedy run of the same
weights without a deadline (`tiny`) to compare the cut text with."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import pytest
import requests
import sseclient
from text_generation import Client
from text_generation.types import FinishReason

from tiny_store import DEADLINE, DEADLINE_SECONDS, REASONER

pytestmark = pytest.mark.integration

PROMPT = "Once upon a time"
MANY = 4000  # tokens asked for: far more than the deadline leaves time for
HEADER, ATTRIBUTES = "X-LMI-Deadline-Exceeded", "X-Amzn-SageMaker-Custom-Attributes"
COUNTER = re.compile(r'^lmi_serve:generation_deadline_exceeded_total\{model_name="' + DEADLINE + r'"\} (\S+)$', re.M)


def counted(server) -> float:
    found = COUNTER.search(requests.get(server.url("/metrics"), timeout=30).text)
    return float(found.group(1)) if found else 0.0


def post(server, path, body, **kwargs):
    return requests.post(server.url(path), json=body, timeout=120, **kwargs)


def lmi(server, stream: bool):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": MANY, "details": True}, "stream": stream}
    response = post(server, f"/predictions/{DEADLINE}", body)
    return response, [json.loads(line) for line in response.text.splitlines()] if stream else response.json()


def tgi(server):
    response = post(server, f"/generate?model_name={DEADLINE}",
                    {"inputs": PROMPT, "parameters": {"max_new_tokens": MANY, "details": True}})
    return response, response.json()


def tgi_stream(server):
    frames = list(Client(server.base, headers={"model_name": DEADLINE}, timeout=120).generate_stream(
        PROMPT, max_new_tokens=MANY))
    return None, frames


def chat(client, stream: bool):
    messages = [{"role": "user", "content": PROMPT}]
    if stream:
        return None, list(client.chat.completions.create(model=DEADLINE, messages=messages, max_tokens=MANY,
                                                         temperature=0, stream=True))
    raw = client.chat.completions.with_raw_response.create(model=DEADLINE, messages=messages, max_tokens=MANY,
                                                           temperature=0)
    return raw, raw.parse()


def completion(client, model: str, max_tokens: int):
    raw = client.completions.with_raw_response.create(model=model, prompt=PROMPT, max_tokens=max_tokens,
                                                      temperature=0)
    return raw, raw.parse()


def responses(client, stream: bool):
    if stream:
        return None, list(client.responses.create(model=DEADLINE, input=PROMPT, max_output_tokens=MANY,
                                                  temperature=0, stream=True))
    raw = client.responses.with_raw_response.create(model=DEADLINE, input=PROMPT, max_output_tokens=MANY,
                                                    temperature=0)
    return raw, raw.parse()


def messages(client, stream: bool):
    asked = {"model": DEADLINE, "max_tokens": MANY, "messages": [{"role": "user", "content": PROMPT}],
             "extra_body": {"temperature": 0}}  # the client no longer declares it; the Messages API takes it
    if stream:
        with client.messages.stream(**asked) as events:
            return None, (list(events), events.get_final_message())
    raw = client.messages.with_raw_response.create(**asked)
    return raw, raw.parse()


def triton(server, stream: bool):
    body = {"text_input": PROMPT, "max_tokens": MANY, "return_finish_reason": True}
    if stream:
        response = post(server, f"/v2/models/{DEADLINE}/generate_stream", body, stream=True,
                        headers={"Accept": "text/event-stream"})
        return response, [json.loads(event.data) for event in sseclient.SSEClient(response).events()]
    response = post(server, f"/v2/models/{DEADLINE}/generate", body)
    return response, response.json()


@pytest.fixture(scope="module")
def cut(tiny_models_server, openai_client):
    """Every dialect's request to the model with the deadline, sent at once: name -> (response or None for a
    client that hides it, what the dialect answered); `reference` is the greedy run without a deadline."""
    server = tiny_models_server
    before = counted(server)
    openai = openai_client(server, strict=False)  # stream chunks' null finish_reason (conftest.py)
    claude = anthropic.Anthropic(base_url=server.url(""), api_key="x", max_retries=0, timeout=120)
    calls = {
        "lmi": lambda: lmi(server, False), "lmi_stream": lambda: lmi(server, True),
        "tgi": lambda: tgi(server), "tgi_stream": lambda: tgi_stream(server),
        "chat": lambda: chat(openai, False), "chat_stream": lambda: chat(openai, True),
        "completion": lambda: completion(openai, DEADLINE, MANY),
        "responses": lambda: responses(openai, False), "responses_stream": lambda: responses(openai, True),
        "messages": lambda: messages(claude, False), "messages_stream": lambda: messages(claude, True),
        "triton": lambda: triton(server, False), "triton_stream": lambda: triton(server, True),
        "reference": lambda: completion(openai, REASONER, 24),
    }
    started = time.monotonic()
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {name: pool.submit(call) for name, call in calls.items()}
        answers = {name: future.result() for name, future in futures.items()}
    answers["elapsed"] = time.monotonic() - started
    answers["counted"] = counted(server) - before
    answers["sent"] = len(calls) - 1  # every call but the reference asked the model with the deadline
    answers["server"] = server
    return answers


def agree(one: str, other: str) -> None:
    """Two greedy texts of the same prompt and weights, cut at different times: one begins the other."""
    assert one and other and (one.startswith(other) or other.startswith(one)), (one[:200], other[:200])


def assert_marked(response):
    assert response.status_code == 200
    assert response.headers[HEADER] == "true"
    assert "lmi-deadline-exceeded=true" in response.headers[ATTRIBUTES].split(";")


def test_every_request_ends_near_its_deadline(cut):
    # 4,000 tokens would take this model over a minute; cut at 1 s, all of them answered in a few seconds
    assert cut["elapsed"] < DEADLINE_SECONDS + 30


def test_lmi(cut):
    response, body = cut["lmi"]
    assert_marked(response)
    assert body["details"]["finish_reason"] == "length" and body["generated_text"]
    assert 0 < body["details"]["generated_tokens"] < MANY
    response, lines = cut["lmi_stream"]
    assert response.status_code == 200 and HEADER not in response.headers  # sent before the cut was known
    assert lines[-1]["details"]["finish_reason"] == "length"
    assert "".join(line["token"]["text"] for line in lines) == lines[-1]["generated_text"] != ""


def test_tgi(cut):
    response, body = cut["tgi"]
    assert_marked(response)
    assert body["details"]["finish_reason"] == "length" and body["generated_text"]
    _, frames = cut["tgi_stream"]
    assert frames[-1].details.finish_reason == FinishReason.Length
    assert all(frame.details is None for frame in frames[:-1])
    assert "".join(frame.token.text for frame in frames) == frames[-1].generated_text != ""


def test_openai_chat_and_completions(cut):
    raw, answer = cut["chat"]
    assert_marked(raw)
    assert answer.choices[0].finish_reason == "length" and answer.choices[0].message.content
    _, chunks = cut["chat_stream"]
    reasons = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]
    assert reasons == ["length"]  # one finish, and the client saw the stream's end ([DONE])
    agree("".join(c.delta.content or "" for chunk in chunks for c in chunk.choices), answer.choices[0].message.content)
    raw, answer = cut["completion"]
    assert_marked(raw)
    assert answer.choices[0].finish_reason == "length" and 0 < answer.usage.completion_tokens < MANY


def test_cut_text_is_the_greedy_text_so_far(cut):
    """The deadline ends the sequence; it changes none of its tokens: the cut text and the run of the same
    weights without a deadline agree as far as both go."""
    text = cut["completion"][1].choices[0].text
    reference = cut["reference"][1].choices[0].text
    assert HEADER not in cut["reference"][0].headers
    agree(text, reference)


def test_openai_responses(cut):
    raw, response = cut["responses"]
    assert_marked(raw)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text
    _, events = cut["responses_stream"]
    assert events[-1].type == "response.incomplete"
    agree(events[-1].response.output_text, response.output_text)


def test_anthropic(cut):
    raw, message = cut["messages"]
    assert_marked(raw)
    assert message.stop_reason == "max_tokens" and message.content[0].text
    _, (events, final) = cut["messages_stream"]
    assert events[-1].type == "message_stop" and final.stop_reason == "max_tokens"
    agree(final.content[0].text, message.content[0].text)


def test_triton(cut):
    response, body = cut["triton"]
    assert_marked(response)
    assert body["finish_reason"] in ("length", ["length"]) and body["text_output"]
    response, frames = cut["triton_stream"]
    assert response.status_code == 200 and "error" not in frames[-1]
    assert frames[-1]["finish_reason"] in ("length", ["length"])


def test_counter_and_access_log(cut):
    """Every request to the model with the deadline was cut: each counts once, and its access line says so."""
    assert cut["counted"] == cut["sent"]
    server = cut["server"]
    deadline = time.monotonic() + 30
    while True:  # a stream's line is written when its response closes, just after the client read it
        lines = [line for line in server.output().splitlines()
                 if "lmi_serve.access" in line and f"model={DEADLINE} " in line]
        marked = [line for line in lines if line.endswith("deadline_exceeded=True")]
        if len(marked) >= cut["counted"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(marked) == cut["counted"]
    reference = [line for line in server.output().splitlines() if f"model={REASONER} " in line]
    assert reference and not any("deadline_exceeded" in line for line in reference)
