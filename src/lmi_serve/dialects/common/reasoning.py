"""Reasoning models: the block a model thinks in before it answers, told apart from the answer.

Qwen3, SmolLM3 and the DeepSeek-R1 distills write `<think> ... </think>` and then the answer; Granite
3.2 (thinking on) "Here is my thought process:" ... "Here is my response:", plain text, where its
template asks for them (`granite`); Gemma 4 `<|channel>thought ... <channel|>` (`gemma4`) and Magistral
`[THINK] ... [/THINK]` (`mistral`), special tokens. This
module knows only text and grammars (the engine never learns about reasoning):
- `markers(tokenizer, parser)`: which markers a model uses, from `option.reasoning_parser` or, on
  `auto`, from the model itself (the chat template mentions `<think>`, or the vocabulary holds both
  markers as tokens); None when it does not reason (or the option says `none`).
- `start_state(prompt, markers)`: where the output starts. A prompt ending with the opening marker
  (R1-distill templates, thinking Qwen3 variants) puts it inside the block; one ending with the
  closing marker (Qwen3's `enable_thinking: false` writes an empty block) makes it all answer;
  otherwise the model may open a block first.
- `Splitter`: fed the output piece by piece, it hands back (reasoning, content) pieces. The markers
  never appear in either, whitespace right after a marker is dropped, and a marker split across
  pieces is held until it is known; any chunking of a text splits as the whole text does.
- `wrap_grammar`: a response_format / tool / vLLM grammar made to apply only after the block: free
  reasoning text up to the closing marker, then the original grammar; with a token budget, the
  block ends after at most that many tokens (llguidance's `max_tokens`, which needs the markers to
  be tokens of their own).
"""

from __future__ import annotations

import dataclasses
import json
import weakref
from dataclasses import dataclass
from typing import Literal

from lmi_serve.dialects.common import harmony
from lmi_serve.engine.sampling.grammar import JSON_LAYOUT
from lmi_serve.engine.types import GuidedDecoding

Start = Literal["inside", "maybe", "answer"]
PARSERS = ("auto", "none", "deepseek_r1", "qwen3", "openai_gptoss", "granite", "gemma4", "mistral")  # vLLM's names


@dataclass(frozen=True)
class Markers:
    open: str
    close: str
    tokens: bool = False  # both markers are tokens of their own (what a token budget needs)
    harmony: bool = False  # gpt-oss channels (harmony.py), not a block between two markers
    special: bool = False  # the markers are special tokens: the output is decoded with them kept
    head: str = ""  # where `open` is a token and then text (Gemma 4's label): that token
    ids: tuple[int, ...] = ()  # special markers' token ids (opening or its head, closing), where the tokenizer has them


THINK = ("<think>", "</think>")
# gpt-oss: analysis messages are the reasoning; the tool format's grammar carries them (no wrapping)
HARMONY = Markers(harmony.CHANNEL + "analysis" + harmony.MESSAGE, harmony.END, harmony=True)
# Granite 3.2 with `thinking` on (its template asks for them); Granite 3.3 writes `<think>` instead.
GRANITE = Markers("Here is my thought process:", "Here is my response:")
# Gemma 4 (`<|think|>` in the system turn): a thought channel, its `thought` label part of the opening.
# Its template closes an empty one at the end of the prompt when thinking is off (all answer then).
GEMMA4 = Markers("<|channel>thought", "<channel|>", special=True, head="<|channel>")
# Magistral (tokenizer v13+): `[THINK]` / `[/THINK]` special tokens; its template writes them around thinking chunks.
MISTRAL = Markers("[THINK]", "[/THINK]", special=True)
_BY_NAME = {"openai_gptoss": HARMONY, "granite": GRANITE, "gemma4": GEMMA4, "mistral": MISTRAL}
_detected: "weakref.WeakKeyDictionary[object, Markers | None]" = weakref.WeakKeyDictionary()


def _is_token(tokenizer, text: str) -> bool:
    try:
        token_id = tokenizer.convert_tokens_to_ids(text)
    except (KeyError, ValueError, TypeError):
        return False
    return token_id is not None and token_id != getattr(tokenizer, "unk_token_id", None)


def _with_tokens(tokenizer, found: Markers) -> Markers:
    """Special markers (`found.special`) with their token ids where the tokenizer has both (the
    opening's `head` and the closing), which grammars then name."""
    if not found.special:
        return found
    texts = (found.head or found.open, found.close)
    if not all(_is_token(tokenizer, t) for t in texts):
        return found
    return dataclasses.replace(found, tokens=True, ids=tuple(tokenizer.convert_tokens_to_ids(t) for t in texts))


def markers(tokenizer, parser: str = "auto") -> Markers | None:
    """The reasoning markers of the model `tokenizer` belongs to, as `parser` (option.reasoning_parser)
    says; None when its output is all answer."""
    if parser == "none":
        return None
    if parser in _BY_NAME:
        return _with_tokens(tokenizer, _BY_NAME[parser])
    try:
        cached = _detected[tokenizer]
    except (KeyError, TypeError):
        tokens = all(_is_token(tokenizer, m) for m in THINK)
        template = getattr(tokenizer, "chat_template", None)
        template = " ".join(template.values()) if isinstance(template, dict) else template or ""
        cached = Markers(*THINK, tokens=tokens) if tokens or THINK[0] in template else None
        cached = GRANITE if GRANITE.open in template else cached
        cached = _with_tokens(tokenizer, GEMMA4) if "<|channel>" in template else cached
        cached = _with_tokens(tokenizer, MISTRAL) if MISTRAL.open in template else cached
        cached = HARMONY if harmony.CHANNEL in template else cached
        try:
            _detected[tokenizer] = cached
        except TypeError:  # not weak-referenceable: detected again next time
            pass
    if parser == "auto" or cached is not None:
        return cached
    tokens = all(_is_token(tokenizer, m) for m in THINK)
    return Markers(*THINK, tokens=tokens)  # named explicitly: trusted even where nothing shows it


def start_state(prompt: str, found: Markers | None) -> Start:
    if found is None:
        return "answer"
    if found.harmony:
        return "maybe"  # the output's messages tell
    tail = prompt.rstrip()
    if tail.endswith(found.open):
        return "inside"
    if tail.endswith(found.close):
        return "answer"
    return "maybe"


def _held(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could start `marker` (kept until the next piece)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class Splitter:
    """One choice's output -> (reasoning, content) pieces. `reasoning_tokens` counts the pieces
    (tokens) that fell, wholly or partly, into the block, markers included."""

    def __init__(self, found: Markers | None, start: Start):
        self.markers = found
        self.state = "answer" if found is None else {"inside": "after_open", "maybe": "maybe"}.get(start, "answer")
        self.buffer = ""
        self.reasoning_tokens = 0

    def feed(self, piece: str, *, token: bool = True) -> tuple[str, str]:
        before = self.state
        reasoning, content = self._feed(piece)
        entered = before != self.state and self.state in ("after_open", "inside", "after_close")
        if token and (before in ("after_open", "inside") or entered):
            self.reasoning_tokens += 1
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held, once the output has ended: an unfinished block is reasoning, text
        that never became a block is content."""
        held, self.buffer = self.buffer, ""
        if self.state in ("inside", "after_open"):
            return held, ""
        return "", held

    def _feed(self, piece: str) -> tuple[str, str]:
        reasoning, content = [], []
        text = self.buffer + piece
        self.buffer = ""
        while text:
            if self.state == "answer":
                content.append(text)
                break
            if self.state == "maybe":
                stripped = text.lstrip()
                if stripped.startswith(self.markers.open):
                    text, self.state = stripped[len(self.markers.open):], "after_open"
                elif self.markers.open.startswith(stripped):
                    self.buffer = text  # still possibly the opening marker (or only whitespace)
                    break
                else:
                    self.state = "answer"
            elif self.state in ("after_open", "after_close"):
                text = text.lstrip()
                if text:
                    self.state = "inside" if self.state == "after_open" else "answer"
            else:  # inside
                end = text.find(self.markers.close)
                if end >= 0:
                    reasoning.append(text[:end])
                    text, self.state = text[end + len(self.markers.close):], "after_close"
                else:
                    keep = _held(text, self.markers.close)
                    reasoning.append(text[:len(text) - keep])
                    self.buffer = text[len(text) - keep:]
                    break
        return "".join(reasoning), "".join(content)


def splitter(found: Markers | None, start: Start) -> Splitter | harmony.Splitter:
    """The splitter of one choice's output (both kinds have `feed`, `finish`, `reasoning_tokens`)."""
    return harmony.Splitter() if found is not None and found.harmony else Splitter(found, start)


def split(text: str, found: Markers | None, start: Start) -> tuple[str, str]:
    """(reasoning, content) of a whole output."""
    splitter_ = splitter(found, start)
    reasoning, content = splitter_.feed(text, token=False)
    rest = splitter_.finish()
    return reasoning + rest[0], content + rest[1]


# ---- grammars -------------------------------------------------------------------------------------

# What a model writes between the closing marker and its answer (Qwen3: "\n\n"); bounded, since a
# small model given free whitespace can pad forever.
_WS = "/[ \\t\\n]{0,4}/"


def _lark_regex(pattern: str) -> str:
    """`pattern` as a Lark regex literal: unescaped slashes escaped, newlines written out."""
    out, escaped = [], False
    for char in pattern:
        if char == "/" and not escaped:
            out.append("\\/")
        elif char == "\n":
            out.append("\\n")
        else:
            out.append(char)
        escaped = char == "\\" and not escaped
    return "/" + "".join(out) + "/"


def as_lark(guided: GuidedDecoding | None) -> str:
    """The original grammar as one Lark expression."""
    if guided is None:
        return "/(.|\\n)*/"
    if guided.json_schema is not None:
        return "%json " + json.dumps({**json.loads(guided.json_schema), "x-guidance": JSON_LAYOUT})
    if guided.regex is not None:
        return _lark_regex(guided.regex)
    return "%lark {\n" + (guided.lark or "") + "\n}"


def wrap_grammar(guided: GuidedDecoding | None, found: Markers | None, start: Start,
                 budget: int | None = None) -> GuidedDecoding | None:
    """`guided` applying only after the reasoning block (None stays None unless a budget bounds the
    block). With `budget`, the block holds at most that many tokens; it needs `found.tokens`."""
    if found is None or found.harmony or start == "answer" or (guided is None and budget is None):
        return guided
    if found.tokens:  # llguidance reads added tokens as special ones: `<name>` or `<[id]>` names them
        if found.ids:
            opening, closing = (f"<[{i}]>" for i in found.ids)
        else:
            opening, closing = f"<{found.open[1:-1]}>", f"<{found.close[1:-1]}>"
        if found.head:  # then the opening's text (Gemma 4's `thought` label)
            opening += " " + json.dumps(found.open[len(found.head):])
        bound = f"[max_tokens={budget}]" if budget is not None else ""
        rules = [f"reason{bound}: REASON", "REASON: /(.|\\n)*/"]
        block = f"reason {closing}"
    else:  # the markers are plain text: a lazy rule ends the block at the first closing marker
        opening = json.dumps(found.open)
        rules = [f"reason[lazy]: /(.|\\n)*{_lark_regex(found.close)[1:-1]}/"]
        block = "reason"
    if start == "inside":
        head = f"start: {block} {_WS} answer"
    else:
        head = f"start: ({opening} {block} {_WS})? answer"
    return GuidedDecoding(lark="\n".join([head, f"answer: {as_lark(guided)}", *rules]) + "\n")
