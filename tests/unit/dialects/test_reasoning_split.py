"""dialects/common/reasoning.py: markers found from the real chat templates of Qwen3 and the
DeepSeek-R1 distills, where the output starts, the incremental split, and grammars that apply only
after the reasoning block (compiled and run by llguidance over a real tokenizer)."""

from __future__ import annotations

import json
import random

import pytest

from lmi_serve.dialects.common import reasoning
from lmi_serve.dialects.common.reasoning import Markers, Splitter, split
from lmi_serve.dialects.openai import chat
from lmi_serve.dialects.openai.schema import ChatCompletionRequest, parse
from lmi_serve.engine.sampling.grammar import GrammarCompiler
from lmi_serve.engine.types import GuidedDecoding
from server_process import FIXTURES

TEMPLATES = FIXTURES / "chat_templates"
THINK = Markers("<think>", "</think>")
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
TEXTS = ["<think>\nhmm, 2+2</think>\n\nIt is 4.", "hmm</think>\n\nIt is 4.", "  It is 4.", "<thi", "x </th",
         "<think>a</think>b</think>c", "", "\n\n<think>\n\n</think>\n\n4", "<think>never closed <", "</think>4"]


def _tokenizer(smollm2_model_dir, template: str | None, think_tokens: bool):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_model_dir))
    if think_tokens:
        tokenizer.add_tokens(["<think>", "</think>"])  # added, not special: decoding keeps them (as Qwen3's)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module")
def qwen3(smollm2_model_dir):
    return _tokenizer(smollm2_model_dir, (TEMPLATES / "qwen3.jinja").read_text(), True)


@pytest.fixture(scope="module")
def r1(smollm2_model_dir):
    return _tokenizer(smollm2_model_dir, (TEMPLATES / "deepseek_r1_distill_qwen.jinja").read_text(), True)


@pytest.fixture(scope="module")
def plain(smollm2_model_dir):
    return _tokenizer(smollm2_model_dir, None, False)


# ---- the split ------------------------------------------------------------------------------------

@pytest.mark.parametrize("start", ["inside", "maybe", "answer"])
@pytest.mark.parametrize("text", TEXTS)
def test_any_chunking_splits_as_the_whole_text(start, text):
    whole = split(text, THINK, start)
    rng = random.Random(hash((start, text)) & 0xFFFF)
    chunkings = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    chunkings.append(list(text))  # one character at a time
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
        chunkings.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    for pieces in chunkings:
        splitter = Splitter(THINK, start)
        parts = [splitter.feed(p) for p in pieces] + [splitter.finish()]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == whole, pieces


@pytest.mark.parametrize("text", TEXTS)
def test_the_split_loses_only_the_markers_and_the_whitespace_after_them(text):
    for start in ("inside", "maybe"):
        thought, content = split(text, THINK, start)
        if start == "inside" or text.lstrip().startswith("<think>"):
            assert "<think>" not in thought or start == "inside"
            assert "</think>" not in thought
        squeezed = "".join(text.replace("<think>", "").replace("</think>", "").split())
        assert "".join((thought + content).replace("<think>", "").replace("</think>", "").split()) == squeezed


def test_the_three_starts():
    text = "<think>\nhmm</think>\n\nIt is 4."
    assert split(text, THINK, "maybe") == ("hmm", "It is 4.")
    assert split("hmm</think>\n\nIt is 4.", THINK, "inside") == ("hmm", "It is 4.")
    assert split(text, THINK, "answer") == ("", text)
    assert split("It is 4.", THINK, "maybe") == ("", "It is 4.")
    assert split("cut by max_tokens", THINK, "inside") == ("cut by max_tokens", "")  # never closed: reasoning
    assert split(text, None, "maybe") == ("", text)


def test_reasoning_tokens_count_the_pieces_inside_the_block_markers_included():
    splitter = Splitter(THINK, "maybe")
    for piece in ["<think>", "\n", "hm", "m</th", "ink>", "\n\n", "It", " is 4."]:
        splitter.feed(piece)
    assert splitter.reasoning_tokens == 5  # "<think>" "\n" "hm" "m</th" "ink>"
    inside = Splitter(THINK, "inside")
    for piece in ["hm", "</think>", "4"]:
        inside.feed(piece)
    assert inside.reasoning_tokens == 2


# ---- markers and where the output starts, from the real templates -----------------------------------

@pytest.mark.parametrize("kwargs, start", [({}, "maybe"), ({"enable_thinking": True}, "maybe"),
                                           ({"enable_thinking": False}, "answer")])
def test_qwen3_prompt_equals_apply_chat_template_and_tells_where_the_output_starts(qwen3, kwargs, start):
    body = {"messages": MESSAGES} | ({"chat_template_kwargs": kwargs} if kwargs else {})
    prompt = chat.render_prompt(qwen3, parse(ChatCompletionRequest, body))
    assert prompt == qwen3.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs)
    found = reasoning.markers(qwen3)
    assert found == Markers("<think>", "</think>", tokens=True)
    assert reasoning.start_state(prompt, found) == start


def test_r1_distill_prompt_opens_the_block(r1):
    prompt = chat.render_prompt(r1, parse(ChatCompletionRequest, {"messages": MESSAGES}))
    assert prompt == r1.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<｜Assistant｜><think>\n")
    assert reasoning.start_state(prompt, reasoning.markers(r1)) == "inside"


def test_markers_come_from_the_template_the_vocabulary_or_the_option(smollm2_model_dir, qwen3, plain):
    assert reasoning.markers(plain) is None  # SmolLM2: neither template nor vocabulary
    assert reasoning.markers(plain, "deepseek_r1") == Markers("<think>", "</think>", tokens=False)
    assert reasoning.markers(qwen3, "none") is None
    vocab_only = _tokenizer(smollm2_model_dir, None, True)
    assert reasoning.markers(vocab_only) == Markers("<think>", "</think>", tokens=True)
    template_only = _tokenizer(smollm2_model_dir, (TEMPLATES / "qwen3.jinja").read_text(), False)
    assert reasoning.markers(template_only) == Markers("<think>", "</think>", tokens=False)


# ---- grammars after the block -----------------------------------------------------------------------

_COMPILERS: dict[int, GrammarCompiler] = {}


def _accepts(tokenizer, guided: GuidedDecoding, text: str, ids: list[int] | None = None) -> bool:
    compiler = _COMPILERS.setdefault(id(tokenizer), GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id]))
    constraint = compiler.constraint(guided)
    matcher = constraint._matcher  # the llguidance matcher: consume_token says whether a token fits
    for token in ids if ids is not None else tokenizer(text, add_special_tokens=False).input_ids:
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting()


SCHEMA = GuidedDecoding(json_schema=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                "required": ["a"], "additionalProperties": False}))
REGEX = GuidedDecoding(regex="a/b[0-9]+")
LARK = GuidedDecoding(lark='start: "x" y\ny: "}"+\n')
CASES = [(SCHEMA, '{"a": 1}', '{"a": "1"}'), (REGEX, "a/b12", "a/c12"), (LARK, "x}}", "xy")]


@pytest.mark.parametrize("guided, good, bad", CASES)
def test_the_grammar_applies_after_the_block_only(qwen3, guided, good, bad):
    found = reasoning.markers(qwen3)
    inside = reasoning.wrap_grammar(guided, found, "inside")
    assert _accepts(qwen3, inside, f"free {bad} text</think>\n\n{good}")
    assert not _accepts(qwen3, inside, f"free text</think>\n\n{bad}")
    assert not _accepts(qwen3, inside, good)  # the prompt opened a block: it must close first
    maybe = reasoning.wrap_grammar(guided, found, "maybe")
    assert _accepts(qwen3, maybe, f"<think>\nfree {bad}</think>\n\n{good}") and _accepts(qwen3, maybe, good)
    assert reasoning.wrap_grammar(guided, found, "answer") is guided  # Qwen3 without thinking: as asked


@pytest.mark.parametrize("guided, good, bad", CASES)
def test_plain_text_markers_end_the_block_at_the_first_closing_marker(plain, guided, good, bad):
    found = reasoning.markers(plain, "qwen3")
    inside = reasoning.wrap_grammar(guided, found, "inside")
    assert _accepts(plain, inside, f"free {bad} </thin text</think>\n{good}")
    assert not _accepts(plain, inside, f"free</think>{bad}")
    maybe = reasoning.wrap_grammar(guided, found, "maybe")
    assert _accepts(plain, maybe, f"<think>free</think>{good}") and _accepts(plain, maybe, good)


def test_the_tool_grammar_applies_after_the_block(qwen3):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]
    request = parse(ChatCompletionRequest, {"messages": MESSAGES, "tools": tools, "tool_choice": "required"})
    wrapped = reasoning.wrap_grammar(chat.guided_decoding(request), reasoning.markers(qwen3), "inside")
    assert _accepts(qwen3, wrapped, 'I should add.</think>\n\n<tool_call>\n{"name": "add", "arguments": {"x": 1}}\n</tool_call>')
    assert not _accepts(qwen3, wrapped, "I should add.</think>\n\nIt is 4.")


def test_a_budget_ends_the_block_after_that_many_tokens(qwen3):
    found = reasoning.markers(qwen3)
    close = qwen3.convert_tokens_to_ids("</think>")
    bounded = reasoning.wrap_grammar(None, found, "inside", budget=3)
    words = qwen3(" one two three four", add_special_tokens=False).input_ids
    assert _accepts(qwen3, bounded, "", ids=[*words[:3], close, *qwen3("4", add_special_tokens=False).input_ids])
    assert not _accepts(qwen3, bounded, "", ids=[*words[:4], close])
    assert reasoning.wrap_grammar(None, found, "inside") is None  # nothing to bound, nothing to constrain


def test_a_reply_sent_back_keeps_its_reasoning_for_the_template(qwen3):
    """Clients append the assistant message as received; Qwen3's template renders its reasoning_content
    in the turn after the last user message, as apply_chat_template does."""
    turns = [*MESSAGES, {"role": "assistant", "content": "4", "reasoning_content": "Two and two."},
             {"role": "tool", "content": "ok", "tool_call_id": "call_1"}]
    prompt = chat.render_prompt(qwen3, parse(ChatCompletionRequest, {"messages": turns}))
    assert prompt == qwen3.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert "<think>\nTwo and two.\n</think>\n\n4" in prompt
