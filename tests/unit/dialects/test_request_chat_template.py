"""The chat template through the routes (Flask's test client, a scripted engine, SmolLM2's tokenizer):
option.chat_template (put on the tokenizer at load) renders /v1/chat/completions and /tokenize; a
request's `chat_template` is a 400 naming the field and option.trust_request_chat_template unless the
model trusts it, and then replaces the model's template for that request alone."""

from __future__ import annotations

import copy
import queue
from types import SimpleNamespace

import pytest

from lmi_serve.config.sources import ServerConfig
from lmi_serve.engine.generation import Generation
from lmi_serve.engine.handle import RequestHandle
from lmi_serve.engine.types import FinishReason, TokenEvent
from lmi_serve.model.chat_template import override_chat_template
from lmi_serve.server.app import create_app

OPERATOR = ("{% for m in messages %}<<operator>> {{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<operator>> assistant:{% endif %}")
CLIENT = "{% for m in messages %}<<client>> {{ m.content }}{% endfor %}"
MESSAGES = [{"role": "user", "content": "Hello"}]


class RecordingEngine:
    """Answers every request with one EOS token; keeps the prompts it was given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.max_model_len, self.eos_token_ids = tokenizer, 512, frozenset({2})
        self.vocab_size = len(tokenizer)
        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=self.vocab_size))
        self.prompts: list[str] = []

    def generate(self, requests):
        self.prompts += [self.tokenizer.decode(r.prompt_ids) for r in requests]
        sink = queue.SimpleQueue()
        handles = [RequestHandle(r, None, sink=sink, index=i) for i, r in enumerate(requests)]
        for handle in handles:
            handle.push(TokenEvent(2, "", -0.1, True, FinishReason.EOS_TOKEN))
        return Generation(handles, sink)


class ReadyService:
    task, generates_text, vision = "text-generation", True, None

    def __init__(self, name: str, tokenizer, trusted: bool):
        self.name, self.engine = name, RecordingEngine(tokenizer)
        self.config = SimpleNamespace(trust_request_chat_template=trusted, tool_call_parser=None)

    def require_ready(self) -> None:
        pass

    def rolling_engine(self, routes: str, param: str | None = None):
        return self.engine


@pytest.fixture(scope="module")
def services(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    override_chat_template(tokenizer, None, OPERATOR)  # what the handler does with option.chat_template
    return {"strict": ReadyService("strict", tokenizer, trusted=False),
            "trusting": ReadyService("trusting", tokenizer, trusted=True)}


@pytest.fixture(scope="module")
def client(services):
    config = ServerConfig.model_construct(max_request_size=100_000, request_id_header="x-request-id",
                                          triton_server_name="triton", models=())
    return create_app(config, SimpleNamespace(services=services)).test_client()


def chat(client, model: str, **body):
    return client.post("/v1/chat/completions", json={"model": model, "messages": MESSAGES, "max_tokens": 4, **body})


def tokenize(client, model: str, **body):
    return client.post("/tokenize", json={"model": model, "messages": MESSAGES, **body})


def test_option_chat_template_renders_chat_and_tokenize(client, services, smollm2_tokenizer):
    reply = chat(client, "strict")
    assert reply.status_code == 200, reply.get_data(as_text=True)
    assert services["strict"].engine.prompts[-1] == "<<operator>> user: Hello\n<<operator>> assistant:"
    tokens = tokenize(client, "strict").get_json()["tokens"]
    assert smollm2_tokenizer.decode(tokens) == services["strict"].engine.prompts[-1]
    assert reply.get_json()["usage"]["prompt_tokens"] == len(tokens)


@pytest.mark.parametrize("send", [chat, tokenize])
def test_a_request_template_is_a_400_naming_it_and_the_option_by_default(client, services, send):
    before = len(services["strict"].engine.prompts)
    reply = send(client, "strict", chat_template=CLIENT)
    assert reply.status_code == 400, reply.get_data(as_text=True)
    error = reply.get_json()["error"]
    assert error["param"] == "chat_template" and error["type"] == "invalid_request_error"
    assert "`chat_template`" in error["message"] and "option.trust_request_chat_template=true" in error["message"]
    assert len(services["strict"].engine.prompts) == before  # nothing was generated


def test_an_empty_request_template_asks_for_nothing(client, services):
    assert chat(client, "strict", chat_template="").status_code == 200
    assert services["strict"].engine.prompts[-1].startswith("<<operator>>")


def test_a_trusted_request_template_replaces_the_models_for_that_request(client, services, smollm2_tokenizer):
    reply = chat(client, "trusting", chat_template=CLIENT)
    assert reply.status_code == 200, reply.get_data(as_text=True)
    assert services["trusting"].engine.prompts[-1] == "<<client>> Hello"
    tokens = tokenize(client, "trusting", chat_template=CLIENT).get_json()["tokens"]
    assert smollm2_tokenizer.decode(tokens) == "<<client>> Hello"
    chat(client, "trusting")  # the next request without one: the model's template again
    assert services["trusting"].engine.prompts[-1].startswith("<<operator>> user: Hello")


@pytest.mark.parametrize("template", ["{% for m in messages %}", "{{ raise_exception('no') }}", "{{ 1 / 0 }}"])
@pytest.mark.parametrize("send", [chat, tokenize])
def test_a_trusted_template_that_fails_is_a_400_naming_it(client, send, template):
    reply = send(client, "trusting", chat_template=template)
    assert reply.status_code == 400, reply.get_data(as_text=True)
    error = reply.get_json()["error"]
    assert error["param"] == "chat_template" and "chat_template failed" in error["message"]


@pytest.mark.parametrize("send", [chat, tokenize])
def test_a_template_in_chat_template_kwargs_stays_refused_even_when_trusted(client, send):
    reply = send(client, "trusting", chat_template_kwargs={"chat_template": CLIENT})
    assert reply.status_code == 400 and reply.get_json()["error"]["param"] == "chat_template_kwargs"
