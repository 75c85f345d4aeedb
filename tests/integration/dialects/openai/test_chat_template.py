"""option.chat_template and a request's `chat_template` through the real server and the official
`openai` client. `templated` (the shared tiny store, integration/conftest.py) is SmolLM2 with an operator's template
file in its folder and option.trust_request_chat_template=true; `llama-json` is SmolLM2 as shipped,
which does not trust requests' templates (the default)."""

from __future__ import annotations

import openai
import pytest
import requests

from tiny_store import TEMPLATED, TOOL_PARSER as UNTRUSTING

pytestmark = pytest.mark.integration

USER = [{"role": "user", "content": "Hello"}]
CLIENT_TEMPLATE = "{% for m in messages %}<<client>> {{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def server(tiny_models_server):
    return tiny_models_server  # the shared tiny store (integration/conftest.py): TEMPLATED, UNTRUSTING among it


def tokenize(server, model: str, **body) -> dict:
    reply = requests.post(server.url("/tokenize"), json={"model": model, "messages": USER, **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_the_operators_template_renders_every_route(server, openai_client, tokenizer):
    tokens = tokenize(server, TEMPLATED)["tokens"]
    assert tokenizer.decode(tokens) == "<<operator>> user: Hello\n<<operator>> assistant:"
    whole = openai_client(server).chat.completions.create(model=TEMPLATED, messages=USER, max_tokens=1)
    assert whole.usage.prompt_tokens == len(tokens)
    lmi = requests.post(server.url(f"/predictions/{TEMPLATED}"), json={"messages": USER, "max_tokens": 1}, timeout=120)
    assert lmi.status_code == 200, lmi.text
    assert lmi.json()["usage"]["prompt_tokens"] == len(tokens)
    shipped = tokenize(server, UNTRUSTING)["tokens"]  # the checkpoint's template, on the same weights
    assert "<<operator>>" not in tokenizer.decode(shipped) and shipped != tokens


def test_a_request_template_is_refused_by_default_naming_it_and_the_option(server, openai_client):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client(server).chat.completions.create(model=UNTRUSTING, messages=USER, max_tokens=1,
                                                      extra_body={"chat_template": CLIENT_TEMPLATE})
    assert caught.value.status_code == 400 and caught.value.param == "chat_template"
    assert "option.trust_request_chat_template" in caught.value.message
    refused = requests.post(server.url("/tokenize"), timeout=60,
                            json={"model": UNTRUSTING, "messages": USER, "chat_template": CLIENT_TEMPLATE})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"


def test_a_trusted_request_template_replaces_the_models_for_that_request(server, openai_client, tokenizer):
    tokens = tokenize(server, TEMPLATED, chat_template=CLIENT_TEMPLATE)["tokens"]
    assert tokenizer.decode(tokens) == "<<client>> Hello"
    client = openai_client(server)
    whole = client.chat.completions.create(model=TEMPLATED, messages=USER, max_tokens=1,
                                           extra_body={"chat_template": CLIENT_TEMPLATE})
    assert whole.usage.prompt_tokens == len(tokens)
    with pytest.raises(openai.BadRequestError) as caught:  # a broken template is the client's 400, not a 500
        client.chat.completions.create(model=TEMPLATED, messages=USER, max_tokens=1,
                                       extra_body={"chat_template": "{% for m in messages %}"})
    assert caught.value.param == "chat_template"
