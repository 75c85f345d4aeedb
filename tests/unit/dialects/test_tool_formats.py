"""Tool calls in each family's format (dialects/openai/tool_formats/), against the families' real
chat templates (tests/fixtures/chat_templates/): the format a template implies, the prompt with
tools and a past call equal to apply_chat_template's, parsers that round-trip what the formats
render, and, through OpenAIService on a tiny random-weights model, `required` calls the grammar
makes parseable, streamed in deltas that add up to the whole response, in shapes the `openai`
client's own types accept."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionToolParam
from transformers import AutoTokenizer

from lmi_serve.dialects.openai import chat, tool_formats
from lmi_serve.dialects.openai.schema import ChatCompletionRequest, parse
from lmi_serve.dialects.openai.service import OpenAIService
from lmi_serve.dialects.openai.tool_formats import FORMATS
from lmi_serve.dialects.openai.tool_stream import ToolCallStream
from lmi_serve.engine.engine import Engine

TEMPLATES = Path(__file__).resolve().parents[2] / "fixtures" / "chat_templates"
FAMILIES = {  # format -> its template
    "hermes": "qwen2.5-instruct.jinja",
    "llama3_json": "llama-3.2-instruct.jinja",
    "mistral": "mistral-7b-instruct-v0.3.jinja",
    "pythonic": "gemma3-pythonic-vllm.jinja",
}
# Enums and bounds keep a random-weights model's arguments short: the grammar decides their shape.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time now",
    "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}}, "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


def call_id(family: str) -> str:
    return "a1b2c3d4e" if family == "mistral" else "call_1"  # Mistral's template wants 9 characters


@pytest.fixture(scope="module")
def tokenizers(smollm2_model_dir):
    """SmolLM2's tokenizer wearing each family's template (same vocabulary as the tiny model)."""
    loaded = {}
    for family, name in FAMILIES.items():
        tokenizer = AutoTokenizer.from_pretrained(str(smollm2_model_dir))
        tokenizer.chat_template = (TEMPLATES / name).read_text()
        loaded[family] = tokenizer
    return loaded


@pytest.mark.parametrize("family", FAMILIES)
def test_the_template_implies_its_format_and_the_option_overrides_it(tokenizers, family):
    assert chat.tool_format_for(tokenizers[family]).name == family
    assert chat.tool_format_for(tokenizers[family], "pythonic").name == "pythonic"


def test_templates_without_markers_get_hermes(smollm2_tokenizer):
    assert chat.tool_format_for(smollm2_tokenizer).name == "hermes"
    assert tool_formats.detect(None).name == "hermes"


def test_the_option_names_are_the_configs():
    from typing import get_args

    from lmi_serve.config.models import ToolCallParser

    assert set(get_args(ToolCallParser)) == set(tool_formats.NAMES)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_with_tools_and_a_past_call_is_apply_chat_templates(tokenizers, family):
    tokenizer, cid = tokenizers[family], call_id(family)
    call = {"id": cid, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    reference = [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": cid, "content": "sunny"}]
    wire_call = {**call, "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    request = parse(ChatCompletionRequest, {
        "messages": [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [wire_call]},
                     {"role": "tool", "tool_call_id": cid, "content": "sunny"}],
        "tools": [WEATHER, TIME]})
    expected = tokenizer.apply_chat_template(reference, tools=[WEATHER, TIME], tokenize=False,
                                             add_generation_prompt=True)
    assert chat.render_prompt(tokenizer, request, tool_format=FORMATS[family]) == expected
    assert "get_time" in expected and "sunny" in expected


@pytest.mark.parametrize("family", FAMILIES)
def test_rendered_calls_parse_back(family):
    fmt = FORMATS[family]
    calls = [("get_weather", {"city": "Paris", "days": 3, "nested": {"ok": True, "none": None}}), ("get_time", {})]
    calls = calls if fmt.parallel else calls[:1]
    parsed = chat.parse_tool_calls(fmt.render_calls(calls), fmt)
    assert parsed.content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == calls
    assert len({c["id"] for c in parsed.tool_calls}) == len(calls)


NATIVE = {  # what each family's model writes, as the text reaches the server (special tokens kept or not)
    "hermes": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'],
    "llama3_json": ['{"name": "get_weather", "parameters": {"city": "Paris"}}',
                    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'],
    "mistral": ['[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
                '[{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]'],
    "pythonic": ['[get_weather(city="Paris")]', "[get_weather(city='Paris')]"],
}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_reads_its_native_output_and_leaves_text_alone(family):
    fmt = FORMATS[family]
    for text in NATIVE[family]:
        parsed = chat.parse_tool_calls(text, fmt)
        assert [json.loads(c["function"]["arguments"]) for c in parsed.tool_calls] == [{"city": "Paris"}], text
        assert fmt.is_call_start(text)
    for text in ("Hello there", NATIVE[family][0][:-2], "[1, 2]", '{"a": 1}', "[x + 1]"):
        parsed = chat.parse_tool_calls(text, fmt)
        assert parsed.content == text and not parsed.tool_calls


def test_pythonic_refuses_names_python_cannot_write_naming_tools():
    from lmi_serve.errors import InvalidRequest

    bad = {"type": "function", "function": {"name": "get-weather", "parameters": {"type": "object"}}}
    bad_parameter = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"first name": {"type": "string"}}}}}
    for tool in (bad, bad_parameter):
        request = parse(ChatCompletionRequest, {"messages": QUESTION, "tools": [TIME, tool], "tool_choice": "required"})
        with pytest.raises(InvalidRequest) as caught:
            chat.guided_decoding(request, FORMATS["pythonic"])
        assert caught.value.param == "tools" and "tools[1]" in caught.value.message
        assert chat.guided_decoding(request, FORMATS["hermes"]) is not None  # JSON formats take any name


def test_mistral_call_ids_fit_its_template():
    ids = {FORMATS["mistral"].new_call_id() for _ in range(20)}
    assert all(len(i) == 9 and i.isalnum() for i in ids) and len(ids) == 20


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral"])
def test_json_arguments_stream_as_written_and_add_up(family):
    fmt = FORMATS[family]
    text = NATIVE[family][0]
    stream, fragments, first = ToolCallStream(fmt), [], None
    for end in range(1, len(text) + 1):
        for delta in stream.deltas(text[:end]):
            if "id" in delta:
                first = delta
            fragments.append(delta["function"]["arguments"])
    fragments += [d["function"]["arguments"] for d in stream.deltas(text, final=True)]
    assert first["function"]["name"] == "get_weather" and first["type"] == "function" and first["index"] == 0
    assert len(fragments) > 5  # incremental, not one whole call at the end
    assert "".join(fragments) == chat.parse_tool_calls(text, fmt).tool_calls[0]["function"]["arguments"]


def test_grammars_per_format_and_parallel_tool_calls():
    request = parse(ChatCompletionRequest, {"messages": QUESTION, "tools": [WEATHER, TIME], "tool_choice": "required"})
    single = parse(ChatCompletionRequest, {"messages": QUESTION, "tools": [WEATHER, TIME], "tool_choice": "required",
                                           "parallel_tool_calls": False})
    auto = parse(ChatCompletionRequest, {"messages": QUESTION, "tools": [WEATHER]})
    lark = {name: chat.guided_decoding(request, fmt).lark for name, fmt in FORMATS.items()}
    assert "call+" in lark["hermes"] and "call)*" in lark["mistral"] and "call)*" in lark["pythonic"]
    assert "calls: call\n" in lark["llama3_json"]  # Llama 3 writes one call per turn
    assert all("calls: call\n" in chat.guided_decoding(single, fmt).lark for fmt in FORMATS.values()
               if fmt.name in ("hermes", "llama3_json"))
    assert all("call)*" not in chat.guided_decoding(single, fmt).lark for fmt in FORMATS.values())
    assert '"parameters"' in lark["llama3_json"] and '"[TOOL_CALLS]" " ["' in lark["mistral"]
    assert "TEXT: /[^{<]" in chat.guided_decoding(auto, FORMATS["llama3_json"]).lark
    assert "TEXT: /[^\\[]" in chat.guided_decoding(auto, FORMATS["mistral"]).lark


# ---- through OpenAIService on a tiny random-weights model ---------------------------------------

@pytest.fixture(scope="module")
def engine(tiny_model, smollm2_tokenizer):
    engine = Engine(tiny_model, smollm2_tokenizer, torch.device("cpu"), max_batch_size=8).start()
    yield engine
    engine.stop()


def service_for(engine, tokenizer, family) -> OpenAIService:
    service = OpenAIService(engine, "m", tool_call_parser=family)
    service.tokenizer = tokenizer  # same vocabulary as the engine's; this family's template
    return service


def check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(("family", "choice"), [*((f, "required") for f in FAMILIES), ("llama3_json", NAMED)])
def test_forced_calls_from_random_weights_parse_stream_and_fit_the_client(engine, tokenizers, family, choice):
    service = service_for(engine, tokenizers[family], family)
    body = {"messages": QUESTION, "tools": [WEATHER, TIME], "tool_choice": choice, "max_tokens": 120,
            "temperature": 0, "parallel_tool_calls": False}
    whole = service.chat(parse(ChatCompletionRequest, body)).body
    message = ChatCompletion.model_validate(whole).choices[0].message
    assert whole["choices"][0]["finish_reason"] == "tool_calls" and message.content is None
    assert len(message.tool_calls) == 1
    for call in message.tool_calls:
        check_call(call.function.name, call.function.arguments)
    if isinstance(choice, dict):
        assert message.tool_calls[0].function.name == "get_weather"

    chunks = list(service.chat(parse(ChatCompletionRequest, {**body, "stream": True})).chunks)
    state = ChatCompletionStreamState(input_tools=[ChatCompletionToolParam(**WEATHER), ChatCompletionToolParam(**TIME)])
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    streamed = state.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in message.tool_calls]
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert sum("id" in d for d in deltas) == 1 and deltas[0]["function"]["name"] == message.tool_calls[0].function.name
    if FORMATS[family].streams_arguments:
        assert len(deltas) > 1  # the arguments came in fragments


@pytest.mark.parametrize("family", ["hermes", "mistral", "pythonic"])
def test_parallel_calls_where_the_format_has_them(engine, tokenizers, family):
    service = service_for(engine, tokenizers[family], family)
    body = {"messages": QUESTION, "tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 100,
            "temperature": 1, "seed": 3}
    for seed in range(8):  # some seed writes more than one call; every call of every seed is valid
        whole = service.chat(parse(ChatCompletionRequest, {**body, "seed": seed})).body
        message = ChatCompletion.model_validate(whole).choices[0].message
        if whole["choices"][0]["finish_reason"] == "length":
            continue
        for call in message.tool_calls:
            check_call(call.function.name, call.function.arguments)
        if len(message.tool_calls) > 1:
            return
    pytest.fail("no seed wrote parallel calls")


def test_a_call_cut_by_max_tokens_is_the_same_whole_and_streamed(engine, tokenizers):
    """OpenAI returns a call cut by max_tokens as `tool_calls` with the arguments written so far and
    finish_reason `length`; the stream has sent those fragments already, so the whole response
    says the same (not the text as content)."""
    seen_partial = set()
    for family in ("hermes", "llama3_json", "mistral", "pythonic"):  # pythonic: a cut call is content, both ways
        service = service_for(engine, tokenizers[family], family)
        for max_tokens in (12, 16, 20, 24):
            body = {"messages": QUESTION, "tools": [WEATHER, TIME], "tool_choice": "required",
                    "max_tokens": max_tokens, "temperature": 0, "parallel_tool_calls": False}
            whole = service.chat(parse(ChatCompletionRequest, body)).body
            choice = ChatCompletion.model_validate(whole).choices[0]
            chunks = list(service.chat(parse(ChatCompletionRequest, {**body, "stream": True})).chunks)
            state = ChatCompletionStreamState(
                input_tools=[ChatCompletionToolParam(**WEATHER), ChatCompletionToolParam(**TIME)])
            for chunk in chunks:
                state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
            # The snapshot: get_final_completion refuses any `length` finish (LengthFinishReasonError).
            streamed = state.current_completion_snapshot.choices[0]
            assert streamed.finish_reason == choice.finish_reason, (family, max_tokens)
            assert (streamed.message.content or None) == choice.message.content, (family, max_tokens)  # role chunk: ""
            assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []] == \
                [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []], (family, max_tokens)
            if choice.finish_reason == "length" and choice.message.tool_calls:
                assert choice.message.content is None and whole["choices"][0]["message"]["content"] is None
                arguments = choice.message.tool_calls[0].function.arguments
                fragments = [d["function"]["arguments"] for c in chunks
                             for d in c["choices"][0]["delta"].get("tool_calls", [])]
                assert "".join(fragments) == arguments
                seen_partial.add(family)
            if family == "pythonic" and choice.finish_reason == "length":
                assert choice.message.content and not choice.message.tool_calls
    assert seen_partial == {"hermes", "llama3_json", "mistral"}


# ---- markers as the model's own tokens ----------------------------------------------------------

def _accepts(tokenizer, guided, ids: list[int]) -> bool:
    from lmi_serve.engine.sampling.grammar import GrammarCompiler

    matcher = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id]).constraint(guided)._matcher
    return all(matcher.consume_token(token) for token in ids) and matcher.is_accepting()


def _with_markers(smollm2_model_dir, *, hermes_special: bool = False):
    """SmolLM2's tokenizer holding the families' markers as added tokens, as the real models do:
    Qwen2.5/Qwen3's `<tool_call>` / `</tool_call>` not special (decoding keeps them), Llama 3's
    `<|python_tag|>` and Mistral v0.3's `[TOOL_CALLS]` special."""
    from tokenizers import AddedToken

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_model_dir))
    hermes = [AddedToken(m, special=hermes_special, normalized=False) for m in ("<tool_call>", "</tool_call>")]
    tokenizer.add_tokens(hermes, special_tokens=hermes_special)
    tokenizer.add_tokens([AddedToken(m, special=True, normalized=False) for m in ("<|python_tag|>", "[TOOL_CALLS]")],
                         special_tokens=True)
    return tokenizer


@pytest.fixture(scope="module")
def marked(smollm2_model_dir):
    return _with_markers(smollm2_model_dir)


CUT = {"hermes": NATIVE["hermes"][0], "llama3_json": NATIVE["llama3_json"][1], "mistral": NATIVE["mistral"][0]}


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_markers_the_tokenizer_holds_are_written_as_those_tokens(marked, smollm2_tokenizer, family, choice):
    fmt = FORMATS[family]
    tokens = fmt.marker_tokens(marked)
    assert tokens == {m: marked.convert_tokens_to_ids(m) for m in fmt.markers if m in marked.get_added_vocab()}
    request = parse(ChatCompletionRequest, {"messages": QUESTION, "tools": [WEATHER, TIME], "tool_choice": choice})
    guided = chat.guided_decoding(request, fmt, tokens)
    assert all(f"<[{token_id}]>" in guided.lark for token_id in tokens.values())
    text = CUT[family]
    ids = marked(text, add_special_tokens=False).input_ids
    assert set(tokens.values()) <= set(ids)  # the model's own single tokens...
    assert _accepts(marked, guided, ids)  # ...are what the grammar takes
    spelled = smollm2_tokenizer(text, add_special_tokens=False).input_ids  # the markers in ordinary tokens
    assert not _accepts(marked, guided, spelled)
    # What the engine's detokenizer makes of them (special ones dropped) still parses as the call.
    decoded = marked.decode(ids, skip_special_tokens=True)
    assert (text in decoded) if family == "hermes" else (decoded != text)
    parsed = chat.parse_tool_calls(decoded, fmt)
    assert [json.loads(c["function"]["arguments"]) for c in parsed.tool_calls] == [{"city": "Paris"}]
    if family == "llama3_json":  # the tag may open the call, or not
        assert _accepts(marked, guided, marked(NATIVE[family][0], add_special_tokens=False).input_ids)
    # After a reasoning block the tool grammar is nested (%lark {...}); the tokens still name the markers.
    from lmi_serve.dialects.common import reasoning

    wrapped = reasoning.wrap_grammar(guided, reasoning.Markers("<think>", "</think>"), "inside")
    assert _accepts(marked, wrapped, marked("hmm</think>\n\n", add_special_tokens=False).input_ids + ids)


def test_markers_stay_text_where_they_are_no_tokens_or_decoding_would_drop_them(smollm2_tokenizer, smollm2_model_dir):
    request = parse(ChatCompletionRequest, {"messages": QUESTION, "tools": [WEATHER], "tool_choice": "required"})
    for fmt in FORMATS.values():
        assert fmt.marker_tokens(smollm2_tokenizer) == {}
        assert "<[" not in chat.guided_decoding(request, fmt, fmt.marker_tokens(smollm2_tokenizer)).lark
    # Hermes' parser needs `<tool_call>` in the text: special markers (skipped when decoding) stay text.
    special = _with_markers(smollm2_model_dir, hermes_special=True)
    assert FORMATS["hermes"].marker_tokens(special) == {}
    guided = chat.guided_decoding(request, FORMATS["hermes"], FORMATS["hermes"].marker_tokens(special))
    assert '"<tool_call>"' in guided.lark
    assert FORMATS["mistral"].marker_tokens(special) == {"[TOOL_CALLS]": special.convert_tokens_to_ids("[TOOL_CALLS]")}
