"""The TGI dialect with the official `text-generation` client (strict pydantic models)."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import requests
from text_generation import AsyncClient, Client
from text_generation.errors import GenerationError, NotFoundError, UnknownError, ValidationError
from text_generation.types import FinishReason

pytestmark = pytest.mark.integration

PROMPTS = ["The capital of France is", "Water boils at", "1, 2, 3,", "Once upon a time", "List three colors:",
           "The opposite of hot is", "My favourite food is", "In 1492,"]


@pytest.fixture(scope="module")
def client(default_server):
    return Client(default_server.base, timeout=180)


def test_generate_details(client):
    response = client.generate("Hello, my name is", max_new_tokens=5)
    details = response.details
    assert isinstance(response.generated_text, str)
    assert details.generated_tokens == len(details.tokens) == 5
    assert details.finish_reason == FinishReason.Length
    assert details.seed is None and details.prefill == []
    assert all(isinstance(t.special, bool) for t in details.tokens)


def test_decoder_input_details_and_top_tokens(client):
    response = client.generate("The capital of France is", max_new_tokens=3, decoder_input_details=True,
                               top_n_tokens=3)
    prefill = response.details.prefill
    assert len(prefill) > 1 and prefill[0].logprob is None
    assert all(p.logprob is not None for p in prefill[1:])
    assert len(response.details.top_tokens) == 3 and all(len(t) == 3 for t in response.details.top_tokens)


def test_stop_sequences_and_eos(client):
    stopped = client.generate("The capital of France is", max_new_tokens=20, stop_sequences=["."])
    assert stopped.details.finish_reason == FinishReason.StopSequence
    assert stopped.generated_text == " Paris"
    answered = client.generate("<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n", max_new_tokens=60)
    assert answered.details.finish_reason == FinishReason.EndOfSequenceToken
    assert answered.details.tokens[-1].special is True


def test_seeded_sampling_reports_its_seed(client):
    kwargs = dict(do_sample=True, seed=42, temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=12)
    first = client.generate("Once upon a time", **kwargs)
    assert client.generate("Once upon a time", **kwargs).generated_text == first.generated_text
    assert first.details.seed == 42


def test_return_full_text_best_of_and_truncate(client, default_server):
    full = client.generate("Water boils at", max_new_tokens=3, return_full_text=True)
    assert full.generated_text.startswith("Water boils at")
    best = client.generate("Once upon a time", best_of=2, do_sample=True, max_new_tokens=6)
    assert len(best.details.best_of_sequences) == 1
    raw = requests.post(default_server.url("/generate"), timeout=60, json={
        "inputs": "one two three four five six seven eight nine ten eleven twelve",
        "parameters": {"max_new_tokens": 2, "truncate": 4}})
    assert raw.status_code == 200 and int(raw.headers["x-prompt-tokens"]) == 4


def test_best_of_sequences_report_the_seed_each_was_sampled_with(client, default_server):
    """Sequence i of best_of samples with base seed + i, and each reports its own: sending the base
    seed again gives every sequence back with the same seed. (Replayed alone, a sequence usually
    matches too, but not always: a batch of 3 and a batch of 1 differ in the logits' last bits,
    and a sampled draw can land across a boundary. Greedy output is batch-invariant; see
    test_lmi_rolling.)"""
    kwargs = dict(do_sample=True, temperature=1.5, max_new_tokens=8)

    def by_seed(response) -> dict[int, str]:
        sequences = [(response.details.seed, response.generated_text)]
        sequences += [(s.seed, s.generated_text) for s in response.details.best_of_sequences]
        return dict(sequences)

    first = by_seed(client.generate("Once upon a time", best_of=3, **kwargs))
    assert len(first) == 3 and None not in first
    base = next(seed for seed in first if (seed - 1) % 2**63 not in first)
    assert set(first) == {base, (base + 1) % 2**63, (base + 2) % 2**63}
    # The client refuses `seed` with best_of; this server takes it (the LMI schema it shares allows it).
    again = requests.post(default_server.url("/generate"), timeout=120, json={
        "inputs": "Once upon a time", "parameters": {**kwargs, "best_of": 3, "seed": base, "details": True}})
    assert again.status_code == 200, again.text
    details = again.json()["details"]
    replayed = {details["seed"]: again.json()["generated_text"]}
    replayed.update({s["seed"]: s["generated_text"] for s in details["best_of_sequences"]})
    assert replayed == first


def test_generate_stream_frames(client):
    frames = list(client.generate_stream("The capital of France is", max_new_tokens=8))
    assert len(frames) == 8
    assert all(f.generated_text is None and f.details is None for f in frames[:-1])
    assert frames[-1].details.finish_reason == FinishReason.Length
    assert "".join(f.token.text for f in frames) == frames[-1].generated_text
    assert frames[-1].generated_text == client.generate("The capital of France is", max_new_tokens=8).generated_text


def test_validation_errors(client, default_server):
    with pytest.raises(ValidationError, match="max_new_tokens"):
        client.generate("x", max_new_tokens=100000)
    with pytest.raises(ValidationError):
        list(client.generate_stream("x", max_new_tokens=100000))
    raw = requests.post(default_server.url("/generate"), timeout=30,
                        json={"inputs": "x", "parameters": {"temperature": 0}})
    assert raw.status_code == 422
    assert raw.json() == {"error": "Input validation error: `temperature` must be strictly positive",
                          "error_type": "validation"}
    malformed = requests.post(default_server.url("/generate"), data=b"{", timeout=30)
    assert malformed.status_code == 400 and malformed.json()["error_type"] == "validation"


TGI_ROUTES = ["/", "/generate", "/generate_stream"]


def post_raw(server, path: str, body: str):
    """POST this exact JSON text (json.dumps cannot write 1e400, nor nesting this deep)."""
    return requests.post(server.url(path), data=body.encode(), timeout=60,
                         headers={"Content-Type": "application/json"})


def assert_tgi_error(response, status: int, fragment: str) -> None:
    assert response.status_code == status
    body = response.json()
    assert set(body) == {"error", "error_type"} and fragment in body["error"]


@pytest.mark.parametrize("path", TGI_ROUTES)
def test_bodies_that_are_not_json_we_accept_get_tgi_400(default_server, path):
    assert_tgi_error(post_raw(default_server, path, '{"inputs": "\\ud800"}'), 400, "surrogate")
    assert_tgi_error(post_raw(default_server, path, "[" * 1000 + "]" * 1000), 400, "nested")
    deep_parameters = '{"inputs": "x", "parameters": ' + "[" * 1000 + "]" * 1000 + "}"
    assert_tgi_error(post_raw(default_server, path, deep_parameters), 400, "nested")


@pytest.mark.parametrize("path", TGI_ROUTES)
def test_parameters_given_as_strings_and_their_bounds(default_server, path):
    body = '{"inputs": "Water boils at", "parameters": {"max_new_tokens": "3", "top_k": "5", "temperature": "0.5"}}'
    assert post_raw(default_server, path, body).status_code == 200
    assert_tgi_error(post_raw(default_server, path, '{"inputs": "x", "parameters": {"top_k": "0"}}'), 422, "top_k")
    too_big = '{"inputs": "x", "parameters": {"top_k": %d}}' % 2**63
    assert_tgi_error(post_raw(default_server, path, too_big), 422, "top_k")
    seed = '{"inputs": "x", "parameters": {"seed": %d, "do_sample": true}}' % 2**63
    assert_tgi_error(post_raw(default_server, path, seed), 422, "seed")


def test_best_of_from_the_largest_seed_reports_seeds_that_can_be_sent_back(default_server):
    body = {"inputs": "Once upon a time", "parameters": {"best_of": 2, "seed": 2**63 - 1, "do_sample": True,
                                                         "max_new_tokens": 4, "details": True}}
    details = requests.post(default_server.url("/generate"), json=body, timeout=60).json()["details"]
    assert details["seed"] in (2**63 - 1, 0) and details["best_of_sequences"][0]["seed"] in (2**63 - 1, 0)
    assert details["seed"] != details["best_of_sequences"][0]["seed"]


def test_unknown_paths_raise_the_clients_own_errors(default_server):
    """Paths no dialect owns answer in LMI's shape with `error` too, which the client needs."""
    nowhere = Client(default_server.url("/no/such/route"), timeout=30)
    with pytest.raises(NotFoundError):
        nowhere.generate("Hi", max_new_tokens=2)
    with pytest.raises(NotFoundError):
        list(nowhere.generate_stream("Hi", max_new_tokens=2))
    with pytest.raises(UnknownError, match="not allowed"):
        Client(default_server.url("/ping"), timeout=30).generate("Hi", max_new_tokens=2)


def test_post_root_answers_its_own_413_in_tgi_shape(default_server):
    too_large = requests.post(default_server.url("/"), json={"inputs": "x" * 200_000}, timeout=60)
    assert too_large.status_code == 413 and set(too_large.json()) == {"error", "error_type"}


def test_raw_routes(default_server):
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}
    assert isinstance(requests.post(default_server.url("/generate"), json=body, timeout=60).json(), dict)
    assert isinstance(requests.post(default_server.url("/"), json=body, timeout=60).json(), list)
    assert requests.get(default_server.url("/health"), timeout=10).status_code == 200
    info = requests.get(default_server.url("/info"), timeout=10).json()
    assert {"model_id", "max_input_tokens", "max_total_tokens", "max_concurrent_requests", "version"} <= set(info)
    assert info["model_id"] == "smollm2-135m-instruct"
    unknown = requests.put(default_server.url("/generate"), timeout=10)
    assert unknown.status_code == 405 and "error" in unknown.json()


def test_async_client_concurrent_equals_sequential(client, default_server):
    sequential = [client.generate(p, max_new_tokens=12) for p in PROMPTS]

    async def together():
        async_client = AsyncClient(default_server.base, timeout=180)
        return await asyncio.gather(*(async_client.generate(p, max_new_tokens=12) for p in PROMPTS))

    concurrent = asyncio.run(together())
    for a, b in zip(sequential, concurrent):
        assert b.generated_text == a.generated_text
        assert [t.id for t in b.details.tokens] == [t.id for t in a.details.tokens]


POISONED = {"inputs": "Play the xylophone please", "parameters": {"max_new_tokens": 4}}


def test_a_stream_that_fails_before_its_first_token_answers_an_error_status(store_server):
    """The store's `faulty` model raises in any prefill whose prompt has "xylophone": nothing was
    streamed yet, so the client gets TGI's error body with its status, not a 200 and an error frame."""
    for path, body in (("/generate_stream", POISONED), ("/generate", {**POISONED, "stream": True}),
                       ("/", {**POISONED, "stream": True})):
        response = requests.post(store_server.url(path), headers={"model_name": "faulty"}, json=body, timeout=180)
        assert response.status_code == 424 and response.headers["Content-Type"] == "application/json"
        error = response.json()
        assert set(error) == {"error", "error_type"} and error["error_type"] == "generation"
        assert error["error"].startswith("Request failed during generation: ") and "injected fault" in error["error"]
    client = Client(store_server.base, headers={"model_name": "faulty"}, timeout=180)
    with pytest.raises(GenerationError, match="injected fault"):
        list(client.generate_stream(POISONED["inputs"], max_new_tokens=4))
    healthy = list(client.generate_stream("Hello", max_new_tokens=2))  # the fault failed only its request
    assert len(healthy) == 2 and healthy[-1].details.finish_reason == FinishReason.Length


def test_models_the_tgi_routes_cannot_serve_get_tgi_errors(store_server):
    unknown = requests.post(store_server.url("/generate"), params={"model_name": "nope"}, json=POISONED, timeout=30)
    assert unknown.status_code == 404
    assert unknown.json() == {"error": "Model not found: nope", "error_type": "not_found"}
    dynamic = requests.post(store_server.url("/generate_stream"), params={"model_name": "dynamic"}, json=POISONED,
                            timeout=30)
    assert dynamic.status_code == 422 and dynamic.json()["error_type"] == "validation"
    assert "dynamic batching" in dynamic.json()["error"]


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_grammar_with_the_text_generation_client(client):
    from text_generation.types import Grammar, GrammarType

    prompt = "A person as JSON:"
    out = client.generate(prompt, max_new_tokens=40, grammar=Grammar(type=GrammarType.Json, value=PERSON))
    person = json.loads(out.generated_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert out.details.finish_reason == FinishReason.EndOfSequenceToken
    streamed = list(client.generate_stream(prompt, max_new_tokens=40,
                                           grammar=Grammar(type=GrammarType.Json, value=PERSON)))
    assert "".join(r.token.text for r in streamed) == out.generated_text
    digits = client.generate("Pick a number:", max_new_tokens=10, grammar=Grammar(type=GrammarType.Regex, value="[0-9]{3}"))
    assert re.fullmatch("[0-9]{3}", digits.generated_text)
    with pytest.raises(ValidationError, match="parameters.grammar"):
        client.generate(prompt, max_new_tokens=4, grammar=Grammar(type=GrammarType.Regex, value="(unclosed"))


@pytest.mark.parametrize("path", TGI_ROUTES)
def test_an_invalid_grammar_is_a_422_naming_the_field_on_every_route(default_server, path):
    for grammar, field in (({"type": "regex", "value": "(unclosed"}, "parameters.grammar"),
                           ({"type": "json", "value": {"type": "object", "minProperties": "a"}}, "parameters.grammar"),
                           ({"type": "json", "value": "{oops"}, "parameters.grammar.value"),
                           ({"type": "xml", "value": "<a/>"}, "parameters.grammar.type")):
        body = json.dumps({"inputs": "Hi", "parameters": {"max_new_tokens": 2, "grammar": grammar}})
        assert_tgi_error(post_raw(default_server, path, body), 422, field)


def test_grammar_and_watermark_in_tgi_compat_and_lmi_schemas(store_server, default_server):
    body = {"inputs": "Pick a number:", "parameters": {"max_new_tokens": 10, "watermark": True,
                                                       "grammar": {"type": "regex", "value": "[0-9]{3}"}}}
    compat = requests.post(store_server.url("/invocations"), params={"model_name": "tgi"}, json=body, timeout=180)
    assert compat.status_code == 200 and re.fullmatch("[0-9]{3}", compat.json()[0]["generated_text"])
    lmi = requests.post(default_server.url("/invocations"), json=body, timeout=180)
    assert lmi.status_code == 200 and re.fullmatch("[0-9]{3}", lmi.json()["generated_text"])
    streamed = requests.post(default_server.url("/invocations"), json={**body, "stream": True}, timeout=180)
    lines = [json.loads(line) for line in streamed.text.splitlines() if line]
    assert "".join(line["token"]["text"] for line in lines) == lmi.json()["generated_text"]
    bad = {"inputs": "Hi", "parameters": {"grammar": {"type": "regex", "value": "(unclosed"}}}
    refused = requests.post(store_server.url("/invocations"), params={"model_name": "tgi"}, json=bad, timeout=60)
    assert_tgi_error(refused, 422, "parameters.grammar")
    lmi_refused = requests.post(default_server.url("/invocations"), json=bad, timeout=60)
    assert lmi_refused.status_code == 424 and "parameters.grammar" in lmi_refused.json()["error"]
