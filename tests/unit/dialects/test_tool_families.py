"""Tool-call formats of today's open families (Qwen3-Coder XML, gpt-oss harmony, Mistral v11,
DeepSeek V3/R1 and V3.1, Granite 3.x, Gemma 4), each against its family's published chat template
(tests/fixtures/chat_templates/). The family's own shape is the template's: a call the template
renders as history is what the format reads, and what the format's grammar makes a model write is
the template's rendering of that call, byte for byte. Through OpenAIService on a tiny random-weights
model, forced calls parse, validate against the tool schema, and stream in argument deltas that add
up to the whole response."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionToolParam
from transformers import AutoTokenizer

from lmi_serve.dialects.openai import chat
from lmi_serve.dialects.openai.reasoning import ReasoningSettings
from lmi_serve.dialects.openai.schema import ChatCompletionRequest, parse
from lmi_serve.dialects.openai.service import OpenAIService
from lmi_serve.dialects.openai.tool_formats import FORMATS
from lmi_serve.dialects.openai.tool_stream import ToolCallStream
from lmi_serve.engine.engine import Engine
from test_tool_formats import QUESTION, SCHEMAS, TIME, WEATHER  # the tools the older formats' tests use

TEMPLATES = Path(__file__).resolve().parents[2] / "fixtures" / "chat_templates"
FAMILIES = {  # format -> its family's template
    "qwen3_coder": "Qwen3-Coder.jinja",
    "openai": "openai-gpt-oss-120b.jinja",
    "deepseek_v3": "deepseek_r1_distill_qwen.jinja",  # R1's template; V3's writes calls alike
    "deepseek_v31": "deepseek-ai-DeepSeek-V3.1.jinja",
    "granite": "ibm-granite-granite-3.3-2B-Instruct.jinja",
    "gemma4": "google-gemma-4-26B-A4B-it.jinja",
}
# One forced generation per family (V3's grammar is checked on its tokens below, without a model).
FORCED = [f for f in FAMILIES if f != "deepseek_v3"]
# Granite 3.3's template mentions `<think>`, so the grammar lets a block open first (a random model
# takes it); this test is about the calls.
NO_REASONING = {"granite"}
# DeepSeek's markers are not in SmolLM2's vocabulary: spelled in its byte tokens they are long.
MAX_TOKENS = {"deepseek_v31": 110, "gemma4": 80}
CALL_ID = "a1b2c3d4e"  # 9 letters and digits: Mistral's templates demand it


@pytest.fixture(scope="module")
def tokenizers(smollm2_model_dir):
    """SmolLM2's tokenizer (the tiny model's vocabulary) wearing each family's template."""
    loaded = {}
    for family, name in FAMILIES.items():
        tokenizer = AutoTokenizer.from_pretrained(str(smollm2_model_dir))
        tokenizer.chat_template = (TEMPLATES / name).read_text()
        loaded[family] = tokenizer
    return loaded


def history(tokenizer, calls: list[tuple[str, dict]]) -> str:
    """The family's template rendering an assistant turn that made `calls` (no generation prompt),
    sent back as a client does (arguments as JSON text), through chat.render_prompt: a template that
    renders `tool_calls` gets them (as strings where it joins them to text: DeepSeek's), another
    (Granite's) gets them in the turn's content in the format."""
    turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": CALL_ID, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        for name, args in calls]}
    def render(messages):
        request = parse(ChatCompletionRequest, {"messages": messages, "tools": [WEATHER, TIME]})
        return chat.render_prompt(tokenizer, request, add_generation_prompt=False)
    before, after = render(QUESTION), render([*QUESTION, turn])
    assert after.startswith(before)
    return after[len(before):]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_template_implies_the_format(tokenizers, family):
    assert chat.tool_format_for(tokenizers[family]).name == family
    assert chat.tool_format_for(tokenizers[family], "hermes").name == "hermes"


@pytest.mark.parametrize("family", FAMILIES)
def test_calls_the_template_renders_are_read_and_rendered_alike(tokenizers, family):
    fmt = FORMATS[family]
    calls = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"utc": True})]
    calls = calls if fmt.parallel else calls[:1]
    written = history(tokenizers[family], calls)
    assert fmt.render_calls(calls) in written  # the format writes what the template writes
    turn = fmt.render_calls(calls)
    parsed = chat.parse_tool_calls(turn, fmt)
    assert parsed.content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                       for c in parsed.tool_calls] == calls


@pytest.mark.parametrize("family", FAMILIES)
def test_arguments_stream_in_deltas_that_add_up(family):
    fmt = FORMATS[family]
    text = fmt.render_calls([("get_weather", {"city": "Paris", "days": 3})])
    stream, fragments, first = ToolCallStream(fmt), [], None
    for end in range(1, len(text) + 1):
        for delta in stream.deltas(text[:end]):
            first = first or delta
            fragments.append(delta["function"]["arguments"])
    fragments += [d["function"]["arguments"] for d in stream.deltas(text, final=True)]
    assert first["function"]["name"] == "get_weather" and first["id"] and first["index"] == 0
    assert len([f for f in fragments if f]) >= 3  # a piece at a time, not one whole call at the end
    assert "".join(fragments) == chat.parse_tool_calls(text, fmt).tool_calls[0]["function"]["arguments"]


def test_qwen3_coder_values_are_typed_and_text_stays_content():
    fmt = FORMATS["qwen3_coder"]
    text = ("<tool_call>\n<function=f>\n<parameter=a>\n12\n</parameter>\n<parameter=b>\nTrue\n</parameter>\n"
            "<parameter=c>\nline one\nline two\n</parameter>\n<parameter=d>\n{\"x\": [1]}\n</parameter>\n"
            "</function>\n</tool_call>")
    parsed = chat.parse_tool_calls(text, fmt)
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == \
        {"a": 12, "b": True, "c": "line one\nline two", "d": {"x": [1]}}
    for other in ("Hello", text[:-3], "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>"):
        assert chat.parse_tool_calls(other, fmt).content == other


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v31"])
def test_deepseek_templates_render_past_calls_sent_back(tokenizers, family):
    """DeepSeek's templates add a past call's arguments to text: they get the request's JSON string
    (a mapping would make the template fail), and the turn renders as the format writes it."""
    args = '{"city": "Paris", "days": 3}'
    request = parse(ChatCompletionRequest, {"tools": [WEATHER], "messages": [
        *QUESTION, {"role": "assistant", "content": None, "tool_calls": [
            {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": CALL_ID, "content": "Sunny"}]})
    prompt = chat.render_prompt(tokenizers[family], request)
    assert FORMATS[family].render_calls([("get_weather", json.loads(args))]) in prompt and "Sunny" in prompt


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v31"])
def test_deepseek_grammar_takes_its_marker_tokens_and_writes_the_templates_calls(smollm2_model_dir, family):
    """With DeepSeek's markers as added (not special) tokens, as its tokenizers hold them, the grammar
    names them as those tokens, accepts the calls as the template renders them, and decoding keeps them."""
    from tokenizers import AddedToken

    from lmi_serve.engine.sampling.grammar import GrammarCompiler

    fmt = FORMATS[family]
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_model_dir))
    tokenizer.add_tokens([AddedToken(m, special=False, normalized=False) for m in fmt.markers])
    tokenizer.chat_template = (TEMPLATES / FAMILIES[family]).read_text()
    tokens = fmt.marker_tokens(tokenizer)
    assert set(tokens) == set(fmt.markers)
    calls = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"utc": True})]
    text = fmt.render_calls(calls)
    assert text in history(tokenizer, calls)
    request = parse(ChatCompletionRequest, {"messages": QUESTION, "tools": [WEATHER, TIME], "tool_choice": "required"})
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert set(tokens.values()) <= set(ids)
    matcher = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id]).constraint(
        chat.guided_decoding(request, fmt, tokens))._matcher
    assert all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()
    assert tokenizer.decode(ids) == text


def test_deepseek_calls_read_with_space_between_and_partial_text_stays_content():
    v3, v31 = FORMATS["deepseek_v3"], FORMATS["deepseek_v31"]
    two = v31.render_calls([("get_weather", {"city": "Paris"}), ("get_time", {})])
    spaced = two.replace("<｜tool▁call▁end｜><｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>")
    assert [c["function"]["name"] for c in chat.parse_tool_calls(spaced, v31).tool_calls] == ["get_weather", "get_time"]
    one = v3.render_calls([("get_time", {"utc": True})])
    assert chat.parse_tool_calls(one.removesuffix("<｜tool▁calls▁end｜>"), v3).tool_calls  # ended by end-of-turn
    for text, fmt in ((one[:-40], v3), (one.replace("```json", "```"), v3), ("Hello", v31), (two + " more", v31),
                      (two.replace("get_weather<｜tool▁sep｜>", "get_weather"), v31)):
        assert chat.parse_tool_calls(text, fmt).content == text


# ---- Granite 3.x: `<|tool_call|>[...]`, and Granite 3.2's reasoning phrases ----------------------

def test_granite_lists_the_tools_and_reads_calls_with_or_without_its_marker(tokenizers):
    fmt, tokenizer = FORMATS["granite"], tokenizers["granite"]
    request = parse(ChatCompletionRequest, {"messages": QUESTION, "tools": [WEATHER]})
    prompt = chat.render_prompt(tokenizer, request)
    assert "<|start_of_role|>available_tools<|end_of_role|>" in prompt and '"get_weather"' in prompt
    text = '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
    for written in (text, text.removeprefix("<|tool_call|>")):  # a special marker is dropped from the text
        parsed = chat.parse_tool_calls(written, fmt)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls] == \
            [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    for other in ("Hello", text[:-1], text + " and more"):
        assert chat.parse_tool_calls(other, fmt).content == other


GRANITE_THOUGHT = "Here is my thought process:\nThe user wants weather.\n\nHere is my response:\nIt is sunny."


def test_granite_reasoning_phrases_split_alike_in_any_pieces(smollm2_model_dir):
    from lmi_serve.dialects.common import reasoning

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_model_dir))
    tokenizer.chat_template = "{{ 'Write your thoughts after \\'Here is my thought process:\\'' }}"
    found = reasoning.markers(tokenizer)  # auto: the template asks for the phrases
    assert found == reasoning.markers(tokenizer, "granite") == reasoning.GRANITE
    assert reasoning.markers(AutoTokenizer.from_pretrained(str(smollm2_model_dir)), "granite") == reasoning.GRANITE
    whole = reasoning.split(GRANITE_THOUGHT, found, "maybe")
    assert whole == ("The user wants weather.\n\n", "It is sunny.")
    for cut in range(1, len(GRANITE_THOUGHT)):
        splitter = reasoning.splitter(found, "maybe")
        parts = [splitter.feed(GRANITE_THOUGHT[:cut]), splitter.feed(GRANITE_THOUGHT[cut:]), splitter.finish()]
        assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == whole
    assert reasoning.split("Plain answer.", found, "maybe") == ("", "Plain answer.")


# ---- Gemma 4: `<|tool_call>call:name{key:<|"|>value<|"|>}<tool_call|>`, and its thought channel ----------

GEMMA_ARGS = {"city": "Paris", "note": 'a, b} c:"d"', "days": -3, "opts": {"Unit": "C", "xs": [1.5, 2, None, True]},
              "ids": [{"k": "v"}], "empty": {}}


def test_gemma4_values_convert_to_json_and_malformed_text_stays_content():
    fmt = FORMATS["gemma4"]
    text = fmt.render_calls([("get_weather", GEMMA_ARGS)])
    assert text == ('<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:-3,empty:{},ids:[{k:<|"|>v<|"|>}],'
                    'note:<|"|>a, b} c:"d"<|"|>,opts:{Unit:<|"|>C<|"|>,xs:[1.5,2,None,true]}}<tool_call|>')
    for written in (text, text + "<|tool_response>", text.replace("{city:", '{<|"|>city<|"|>:')):
        parsed = chat.parse_tool_calls(written, fmt)
        assert parsed.content is None and json.loads(parsed.tool_calls[0]["function"]["arguments"]) == GEMMA_ARGS
    for other in ("Hello", text[:-5], text.replace("days:-3", "days:soon"), text.replace(",days", "days"),
                  text + " and more", '<|tool_call>call:f{"a": 1}<tool_call|>'):
        assert chat.parse_tool_calls(other, fmt).content == other


def test_gemma4_history_renders_calls_and_results_through_its_template(tokenizers):
    """A past call (arguments sent back as JSON text) and its tool result go through Gemma 4's own
    template: the call as the format writes it, the result as a `<|tool_response>` named by the call."""
    tokenizer, fmt = tokenizers["gemma4"], FORMATS["gemma4"]
    request = parse(ChatCompletionRequest, {"tools": [WEATHER], "messages": [
        *QUESTION, {"role": "assistant", "content": None, "tool_calls": [
            {"id": CALL_ID, "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(GEMMA_ARGS)}}]},
        {"role": "tool", "tool_call_id": CALL_ID, "content": "Sunny"}]})
    prompt = chat.render_prompt(tokenizer, request)
    assert "<|tool>declaration:get_weather{" in prompt
    assert prompt.endswith(fmt.render_calls([("get_weather", GEMMA_ARGS)])
                           + '<|tool_response>response:get_weather{value:<|"|>Sunny<|"|>}<tool_response|>')


def test_gemma4_grammar_takes_its_marker_tokens_and_writes_the_templates_calls(smollm2_model_dir):
    """With Gemma 4's markers as special tokens, the grammar names them as those tokens and accepts
    exactly the template's rendering: keys in its order, enums, bounds, nested values by schema."""
    from tokenizers import AddedToken

    from lmi_serve.engine.sampling.grammar import GrammarCompiler

    fmt = FORMATS["gemma4"]
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_model_dir))
    tokenizer.add_tokens([AddedToken(m, special=True, normalized=False) for m in fmt.markers], special_tokens=True)
    tokenizer.chat_template = (TEMPLATES / FAMILIES["gemma4"]).read_text()
    tokens = fmt.marker_tokens(tokenizer)
    assert set(tokens) == set(fmt.markers)
    nested = {"type": "function", "function": {"name": "plan", "parameters": {"type": "object", "required": ["city"],
              "properties": {"city": WEATHER["function"]["parameters"]["properties"]["city"],
                             "note": {"type": "string"},
                             "opts": {"type": "object", "required": ["on"], "properties": {
                                 "on": {"type": "boolean"}, "xs": {"type": "array", "items": {"type": "number"}}}},
                             "Any": {}}}}}
    request = parse(ChatCompletionRequest, {"messages": QUESTION, "tools": [nested, WEATHER, TIME],
                                            "tool_choice": "required"})
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    guided = chat.guided_decoding(request, fmt, tokens)

    def accepted(text: str) -> bool:
        matcher = compiler.constraint(guided)._matcher
        ids = tokenizer(text, add_special_tokens=False).input_ids
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()

    calls = [("plan", {"city": "Rome", "note": "a, b}", "opts": {"on": True, "xs": [1.5, -2]}, "Any": {"k": [None]}}),
             ("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"utc": False})]
    text = fmt.render_calls(calls)
    assert text in history(tokenizer, calls) and accepted(text)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert set(tokens.values()) <= set(ids)
    assert tokenizer.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False) == text
    paris = '<|"|>Paris<|"|>'
    for wrong in (f"days:3,city:{paris}", "city:<|\"|>Lyon<|\"|>", f"city:{paris},days:9", "days:3",
                  f"city:{paris},days:3,extra:1", f"city: {paris}"):  # unsorted, not in the enum, out of bounds,
        assert not accepted(f"<|tool_call>call:get_weather{{{wrong}}}<tool_call|>")  # missing, unknown, spaced


GEMMA_THOUGHT = "<|channel>thought\nThe user wants weather.<channel|>It is sunny."


def test_gemma4_thought_channel_splits_alike_in_any_pieces(tokenizers, smollm2_model_dir):
    from lmi_serve.dialects.common import reasoning

    found = reasoning.markers(tokenizers["gemma4"])  # auto: the template writes the channel
    named = reasoning.markers(AutoTokenizer.from_pretrained(str(smollm2_model_dir)), "gemma4")
    assert found == named == reasoning.GEMMA4
    request = parse(ChatCompletionRequest, {"messages": QUESTION})
    off = chat.render_prompt(tokenizers["gemma4"], request)  # thinking off: the template closes an empty channel
    on = chat.render_prompt(tokenizers["gemma4"], request, template_kwargs={"enable_thinking": True})
    assert reasoning.start_state(off, found) == "answer" and reasoning.start_state(on, found) == "maybe"
    whole = reasoning.split(GEMMA_THOUGHT, found, "maybe")
    assert whole == ("The user wants weather.", "It is sunny.")
    for cut in range(1, len(GEMMA_THOUGHT)):
        splitter = reasoning.splitter(found, "maybe")
        parts = [splitter.feed(GEMMA_THOUGHT[:cut]), splitter.feed(GEMMA_THOUGHT[cut:]), splitter.finish()]
        assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == whole


def test_gemma4_channel_tokens_bound_the_thought_under_a_grammar(smollm2_model_dir):
    """With `<|channel>` / `<channel|>` as special tokens (as Gemma 4's tokenizer holds them), a grammar
    after the channel names them as tokens, so the model can think before a JSON answer, and a budget
    bounds the thought."""
    from tokenizers import AddedToken

    from lmi_serve.dialects.common import guided, reasoning
    from lmi_serve.engine.sampling.grammar import GrammarCompiler

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_model_dir))
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|channel>", "<channel|>")],
                         special_tokens=True)
    found = reasoning.markers(tokenizer, "gemma4")
    assert found.tokens and found.special
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])

    def accepted(text: str, budget=None) -> bool:
        matcher = compiler.constraint(reasoning.wrap_grammar(guided.any_object(), found, "maybe", budget))._matcher
        ids = tokenizer(text, add_special_tokens=False).input_ids
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()

    thought = '<|channel>thought\nThe user wants weather.<channel|>{"city": "Paris"}'
    assert accepted(thought) and accepted('{"city": "Paris"}') and not accepted("It is sunny.")
    assert not accepted(thought, budget=2) and accepted(thought, budget=50)
    ids = tokenizer(thought, add_special_tokens=False).input_ids
    assert reasoning.split(tokenizer.decode(ids, skip_special_tokens=False), found, "maybe") == \
        ("The user wants weather.", '{"city": "Paris"}')


# ---- Magistral: `[THINK] ... [/THINK]` special tokens, then the answer or v11 calls ---------------------

MAGISTRAL_OUTPUT = '[THINK]The user wants weather.[/THINK][TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
# The line of Magistral's published template (mistral-common's, tokenizer v13) that writes a thinking chunk.
MAGISTRAL_TEMPLATE = ("{%- if block['type'] == 'thinking' %}{{- '[THINK]' + block['thinking'] + '[/THINK]' }}"
                      "{%- endif %}")


def test_magistral_think_tokens_split_before_its_calls_and_bound_the_grammar(smollm2_model_dir):
    from tokenizers import AddedToken

    from lmi_serve.dialects.common import reasoning
    from lmi_serve.engine.sampling.grammar import GrammarCompiler

    assert reasoning.markers(AutoTokenizer.from_pretrained(str(smollm2_model_dir)), "mistral") == reasoning.MISTRAL
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_model_dir))
    specials = ("[THINK]", "[/THINK]", "[TOOL_CALLS]", "[ARGS]")
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in specials], special_tokens=True)
    tokenizer.chat_template = MAGISTRAL_TEMPLATE
    found = reasoning.markers(tokenizer)  # auto: the template writes `[THINK]`
    assert found == reasoning.markers(tokenizer, "mistral") and found.special
    assert found.ids == tuple(tokenizer.convert_tokens_to_ids(t) for t in specials[:2])
    ids = tokenizer(MAGISTRAL_OUTPUT, add_special_tokens=False).input_ids
    text = tokenizer.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert text == MAGISTRAL_OUTPUT
    whole = reasoning.split(text, found, "maybe")
    assert whole[0] == "The user wants weather."
    for cut in range(1, len(text)):
        splitter = reasoning.splitter(found, "maybe")
        parts = [splitter.feed(text[:cut]), splitter.feed(text[cut:]), splitter.finish()]
        assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == whole
    parsed = chat.parse_tool_calls(whole[1], FORMATS["mistral"])
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls] == \
        [("get_weather", '{"city": "Paris"}')]

    fmt = FORMATS["mistral"]
    request = parse(ChatCompletionRequest, {"messages": QUESTION, "tools": [WEATHER], "tool_choice": "required"})
    tools = chat.guided_decoding(request, fmt, fmt.marker_tokens(tokenizer))
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])

    def accepted(budget=None) -> bool:
        matcher = compiler.constraint(reasoning.wrap_grammar(tools, found, "maybe", budget))._matcher
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()

    assert accepted() and accepted(budget=50) and not accepted(budget=2)


# ---- gpt-oss harmony: channels split into reasoning, calls and content ------------------------------

HARMONY_ANSWER = ("<|channel|>analysis<|message|>Let me think.<|end|><|start|>assistant<|channel|>final"
                  "<|message|>It is sunny.")
HARMONY_CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}')


def _split_in_pieces(text: str, cuts: list[int]):
    from lmi_serve.dialects.common import reasoning

    splitter = reasoning.splitter(reasoning.HARMONY, "maybe")
    parts = [splitter.feed(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)])] + [splitter.finish()]
    return "".join(p[0] for p in parts), "".join(p[1] for p in parts)


@pytest.mark.parametrize("text", [HARMONY_ANSWER, HARMONY_CALL, "Plain text, no harmony"])
def test_harmony_output_splits_alike_in_any_pieces(text):
    whole = _split_in_pieces(text, [])
    assert _split_in_pieces(text, list(range(1, len(text)))) == whole  # a character at a time
    for cut in range(1, len(text)):
        assert _split_in_pieces(text, [cut]) == whole
    if text is HARMONY_ANSWER:
        assert whole == ("Let me think.", "It is sunny.")
    elif text is HARMONY_CALL:
        assert whole[0] == "Need the weather."
        parsed = chat.parse_tool_calls(whole[1], FORMATS["openai"])
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls] == \
            [("get_weather", '{"city": "Paris"}')]
    else:
        assert whole == ("", text)


def test_harmony_raw_output_is_read_with_its_analysis_skipped():
    fmt = FORMATS["openai"]
    parsed = chat.parse_tool_calls(HARMONY_CALL, fmt)
    assert parsed.content is None and parsed.tool_calls[0]["function"]["name"] == "get_weather"
    assert chat.parse_tool_calls(HARMONY_ANSWER, fmt).content == HARMONY_ANSWER  # a final message is no call


def test_harmony_markers_are_gpt_oss_tokens_in_the_grammar(smollm2_model_dir):
    """With gpt-oss's special tokens in the vocabulary, the grammar takes them as those tokens and
    the output, decoded with special tokens kept, parses as the call."""
    from tokenizers import AddedToken

    from lmi_serve.engine.sampling.grammar import GrammarCompiler

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_model_dir))
    specials = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|constrain|>", "<|return|>"]
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in specials], special_tokens=True)
    fmt = FORMATS["openai"]
    tokens = fmt.marker_tokens(tokenizer)
    assert set(tokens) == set(fmt.markers)
    request = parse(ChatCompletionRequest, {"messages": QUESTION, "tools": [WEATHER], "tool_choice": "auto"})
    guided = chat.guided_decoding(request, fmt, tokens)
    for text in ("<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant to=functions.get_weather<|channel|>"
                 'commentary json<|message|>{"city": "Paris"}',
                 "<|channel|>final<|message|>It is sunny."):
        ids = tokenizer(text, add_special_tokens=False).input_ids
        matcher = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id]).constraint(guided)._matcher
        assert all(matcher.consume_token(t) for t in ids) and matcher.is_accepting(), text
        decoded = tokenizer.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False)
        assert decoded == text


# ---- Mistral v11+: `[TOOL_CALLS]name[ARGS]{...}` ------------------------------------------------

def _mistral_v11(smollm2_model_dir):
    """SmolLM2's tokenizer holding v11's markers as special tokens, wearing Mistral Small 3.2's template."""
    from tokenizers import AddedToken

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_model_dir))
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in ("[TOOL_CALLS]", "[ARGS]")],
                         special_tokens=True)
    tokenizer.chat_template = (TEMPLATES / "Mistral-Small-3.2-24B-Instruct-2506.jinja").read_text()
    return tokenizer


def test_mistral_v11_calls_from_its_template_parse_stream_and_are_what_its_grammar_writes(smollm2_model_dir):
    from lmi_serve.engine.sampling.grammar import GrammarCompiler

    tokenizer, fmt = _mistral_v11(smollm2_model_dir), FORMATS["mistral"]
    assert chat.tool_format_for(tokenizer).name == "mistral"
    calls = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"utc": True})]
    written = history(tokenizer, calls).removesuffix(tokenizer.eos_token)  # `[TOOL_CALLS]f[CALL_ID]id[ARGS]{...}`
    assert "[CALL_ID]" in written and "[ARGS]" in written
    parsed = chat.parse_tool_calls(written, fmt)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == calls

    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'  # what v11 models write
    stream, fragments = ToolCallStream(fmt), []
    for end in range(1, len(text) + 1):
        fragments += [d["function"]["arguments"] for d in stream.deltas(text[:end])]
    assert len([f for f in fragments if f]) >= 3 and "".join(fragments) == '{"city": "Paris", "days": 3}'

    tokens = fmt.marker_tokens(tokenizer)
    assert set(tokens) == {"[TOOL_CALLS]", "[ARGS]"}
    request = parse(ChatCompletionRequest, {"messages": QUESTION, "tools": [WEATHER, TIME], "tool_choice": "required"})
    guided = chat.guided_decoding(request, fmt, tokens)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert set(tokens.values()) <= set(ids)
    matcher = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id]).constraint(guided)._matcher
    assert all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()
    assert tokenizer.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False) == text


# ---- through OpenAIService on a tiny random-weights model ---------------------------------------

@pytest.fixture(scope="module")
def engine(tiny_model, smollm2_tokenizer):
    engine = Engine(tiny_model, smollm2_tokenizer, torch.device("cpu"), max_batch_size=8).start()
    yield engine
    engine.stop()


def service_for(engine, tokenizer, family) -> OpenAIService:
    settings = ReasoningSettings("none") if family in NO_REASONING else None
    service = OpenAIService(engine, "m", tool_call_parser=family, reasoning=settings)
    service.tokenizer = tokenizer  # same vocabulary as the engine's; this family's template
    return service


def ascii_shape(text: str) -> str:
    return re.sub("[^\x00-\x7f]+", "?", text)


@pytest.mark.parametrize("family", FORCED)
def test_forced_calls_are_the_templates_shape_parse_and_stream(engine, tokenizers, family):
    service = service_for(engine, tokenizers[family], family)
    body = {"messages": QUESTION, "tools": [WEATHER, TIME], "tool_choice": "required",
            "max_tokens": MAX_TOKENS.get(family, 50),
            "temperature": 0, "parallel_tool_calls": False}
    whole = service.chat(parse(ChatCompletionRequest, {**body, "logprobs": True})).body
    text = "".join(t["token"] for t in whole["choices"][0]["logprobs"]["content"])  # what the model wrote
    message = ChatCompletion.model_validate(whole).choices[0].message
    assert whole["choices"][0]["finish_reason"] == "tool_calls" and message.content is None, text
    (call,) = message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    # What the grammar made the model write is the template's own rendering of that call.
    # (Compared with each run of non-ASCII characters as one `?`: DeepSeek's markers, spelled in
    # SmolLM2's byte tokens, split inside UTF-8 characters, which a token's own text shows as U+FFFD.)
    rendered = history(tokenizers[family], [(call.function.name, json.loads(call.function.arguments))])
    assert ascii_shape(text.strip()) in ascii_shape(rendered)

    chunks = list(service.chat(parse(ChatCompletionRequest, {**body, "stream": True})).chunks)
    state = ChatCompletionStreamState(input_tools=[ChatCompletionToolParam(**WEATHER), ChatCompletionToolParam(**TIME)])
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    streamed = state.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(call.function.name, call.function.arguments)]
