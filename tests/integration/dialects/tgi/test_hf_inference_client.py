"""huggingface_hub's InferenceClient, built on the server's base URL as a TGI user would, against the
real server: text_generation on TGI's routes and chat_completion on the Messages API."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import huggingface_hub.constants
import pytest
import torch
from huggingface_hub import InferenceClient
from huggingface_hub.errors import ValidationError
from transformers import WatermarkDetector

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 20}},
          "required": ["name", "age", "city"], "additionalProperties": False}
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
# TGI's defaults (gamma 0.5, delta 2.0) with transformers' default key and scheme: what the server uses
TGI_WATERMARK = {"greenlist_ratio": 0.5, "bias": 2.0, "hashing_key": 15485863, "seeding_scheme": "lefthash",
                 "context_width": 1}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def client(default_server):
    # HF_HUB_OFFLINE=1 (a developer's shell locking downloads down) makes the client refuse every
    # request, to localhost too; the client process is put online, for these tests only.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        yield InferenceClient(base_url=default_server.base, timeout=180)


def check_person(text: str) -> None:
    person = json.loads(text)
    assert set(person) == {"name", "age", "city"}, text
    assert isinstance(person["name"], str) and isinstance(person["city"], str)
    assert isinstance(person["age"], int) and 0 <= person["age"] <= 120


# --- text_generation (TGI's POST /) -------------------------------------------------------------

def test_plain_generation_returns_the_prompt_and_text_as_tgi_does(client):
    full = client.text_generation("The capital of France is", max_new_tokens=8)
    text = client.text_generation("The capital of France is", max_new_tokens=8, return_full_text=False)
    assert full == "The capital of France is" + text and "Paris" in text


def test_stream_concatenates_to_the_whole_text_and_details(client):
    whole = client.text_generation("Once upon a time", max_new_tokens=10, details=True, return_full_text=False)
    assert whole.details.generated_tokens == len(whole.details.tokens) == 10
    assert whole.details.finish_reason == "length"
    pieces = list(client.text_generation("Once upon a time", max_new_tokens=10, stream=True, return_full_text=False))
    assert "".join(pieces) == whole.generated_text
    frames = list(client.text_generation("Once upon a time", max_new_tokens=10, stream=True, details=True,
                                         return_full_text=False))
    assert frames[-1].generated_text == whole.generated_text and frames[-1].details.finish_reason == "length"
    assert [f.token.id for f in frames] == [t.id for t in whole.details.tokens]


def test_details_prefill_top_tokens_stop_and_truncate(client):
    out = client.text_generation("The capital of France is", max_new_tokens=3, details=True,
                                 decoder_input_details=True, top_n_tokens=2, truncate=4)
    assert len(out.details.prefill) == 4 and out.details.prefill[0].logprob is None
    assert len(out.details.top_tokens) == 3 and all(len(t) == 2 for t in out.details.top_tokens)
    stopped = client.text_generation("The capital of France is", max_new_tokens=20, stop=["."], details=True,
                                     return_full_text=False)
    assert stopped.details.finish_reason == "stop_sequence" and stopped.generated_text == " Paris"


def test_grammar_json_follows_the_schema_streamed_or_not(client):
    grammar = {"type": "json", "value": PERSON}
    prompt = "Describe a person as JSON with name, age and city:"
    out = client.text_generation(prompt, max_new_tokens=60, grammar=grammar, details=True, return_full_text=False)
    check_person(out.generated_text)
    assert out.details.finish_reason == "eos_token"
    streamed = "".join(client.text_generation(prompt, max_new_tokens=60, grammar=grammar, stream=True,
                                              return_full_text=False))
    assert streamed == out.generated_text
    anything = client.text_generation(prompt, max_new_tokens=60, grammar={"type": "json", "value": {}},
                                      return_full_text=False)
    assert isinstance(json.loads(anything), dict)


def test_grammar_regex_matches_the_whole_output(client):
    out = client.text_generation("Today's date is", max_new_tokens=20, grammar={"type": "regex", "value": DATE},
                                 return_full_text=False)
    assert re.fullmatch(DATE, out), out


def test_grammars_apply_per_row_in_a_mixed_batch(client):
    prompt = "Describe a person as JSON with name, age and city:"
    free_alone = client.text_generation(prompt, max_new_tokens=24, return_full_text=False)
    calls = [dict(grammar={"type": "json", "value": PERSON}, max_new_tokens=60),
             dict(grammar={"type": "regex", "value": DATE}, max_new_tokens=20),
             dict(max_new_tokens=24), dict(grammar={"type": "json", "value": PERSON}, max_new_tokens=60, stream=True)]
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(client.text_generation, prompt, return_full_text=False, **kw) for kw in calls]
        outs = [f.result() for f in futures]
    check_person(outs[0])
    assert re.fullmatch(DATE, outs[1]), outs[1]
    assert outs[2] == free_alone  # greedy output does not depend on the batch or its constraints
    check_person("".join(outs[3]))


@pytest.mark.parametrize("grammar, field", [
    ({"type": "json", "value": {"type": "object", "minProperties": "a"}}, "parameters.grammar"),
    ({"type": "regex", "value": "(unclosed"}, "parameters.grammar"),
    ({"type": "json", "value": "{not json"}, "parameters.grammar.value"),
])
def test_an_invalid_grammar_is_tgis_validation_error_naming_the_field(client, grammar, field):
    with pytest.raises(ValidationError) as caught:
        client.text_generation("Hi", max_new_tokens=4, grammar=grammar)
    assert field in str(caught.value)
    with pytest.raises(ValidationError):
        next(iter(client.text_generation("Hi", max_new_tokens=4, grammar=grammar, stream=True)))


def test_watermark_is_applied_reproducible_and_detected(client, tokenizer):
    # All nine requests at once: they share the engine's steps (a third of the time one by one), and
    # a watermarked row's tokens must not depend on what else is in the batch either.
    prompt, kwargs = "Once upon a time", dict(max_new_tokens=40, return_full_text=False)
    seeded = dict(kwargs, do_sample=True, seed=11, temperature=0.8)
    sampled = dict(max_new_tokens=150, do_sample=True, seed=11, temperature=0.8, details=True)
    calls = {"marked": dict(kwargs, watermark=True), "again": dict(kwargs, watermark=True),
             "plain": dict(kwargs, watermark=False), "stream": dict(kwargs, watermark=True, stream=True),
             "seeded": dict(seeded, watermark=True), "seeded_again": dict(seeded, watermark=True),
             "long_marked": dict(sampled, watermark=True), "long_plain": dict(sampled, watermark=False)}

    def run(options):
        answer = client.text_generation(prompt, **options)
        return "".join(answer) if options.get("stream") else answer

    with ThreadPoolExecutor(len(calls)) as pool:
        out = dict(zip(calls, pool.map(run, calls.values())))
    marked = out["marked"]
    assert out["again"] == marked and out["stream"] == marked and out["plain"] != marked
    assert out["seeded"] == out["seeded_again"]
    detector = WatermarkDetector(model_config(tokenizer), "cpu", TGI_WATERMARK, ignore_repeated_ngrams=True)
    scores = [detector(torch.tensor([[t.id for t in answer.details.tokens]]), return_dict=True)
              for answer in (out["long_marked"], out["long_plain"])]
    assert scores[0].prediction[0] and not scores[1].prediction[0], (scores, out["long_marked"].details.generated_tokens)


def model_config(tokenizer):
    """The served model's config (the detector reads its vocabulary size and BOS id)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tokenizer.name_or_path)


# --- chat_completion (the Messages API) ---------------------------------------------------------

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_without_a_model_name_uses_the_served_model(client):
    # built on a base URL, the client sends "model": "dummy"
    response = client.chat_completion(CAPITAL, max_tokens=12, temperature=0)
    assert "Paris" in response.choices[0].message.content and response.model == MODEL
    named = client.chat_completion(CAPITAL, model=MODEL, max_tokens=12, temperature=0)
    assert named.choices[0].message.content == response.choices[0].message.content


def test_chat_stream_with_usage(client):
    whole = client.chat_completion(CAPITAL, max_tokens=12, temperature=0)
    chunks = list(client.chat_completion(CAPITAL, max_tokens=12, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_tools(client):
    response = client.chat_completion([{"role": "user", "content": "What is the weather in Paris?"}],
                                      tools=[WEATHER_TOOL], tool_choice="required", max_tokens=60, temperature=0)
    call = response.choices[0].message.tool_calls[0]
    arguments = call.function.arguments
    arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert call.function.name == "get_weather" and isinstance(arguments["city"], str)
    assert response.choices[0].finish_reason == "tool_calls"


def test_chat_logprobs(client):
    response = client.chat_completion(CAPITAL, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in content)


def test_chat_json_schema_is_followed(client):
    # the client sends this as TGI's {"type": "json_object", "value": <schema>}
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    response = client.chat_completion([{"role": "user", "content": "Invent a person."}], model=MODEL, max_tokens=60,
                                      temperature=0, response_format=response_format)
    check_person(response.choices[0].message.content)


def test_chat_response_format_in_tgis_own_forms(client):
    dated = client.chat_completion([{"role": "user", "content": "When did it happen?"}], model=MODEL, max_tokens=20,
                                   temperature=0, response_format={"type": "regex", "value": DATE})
    assert re.fullmatch(DATE, dated.choices[0].message.content)
    person = client.chat_completion([{"role": "user", "content": "Invent a person."}], max_tokens=60, temperature=0,
                                    response_format={"type": "json", "value": PERSON})
    check_person(person.choices[0].message.content)
