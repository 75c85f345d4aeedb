"""What every tool-call format shares: the call a scan finds, and scanning one JSON call object.

A format turns the model's text into calls with `scan`, which also works on a prefix of the
output (while streaming): each call found so far has its name and the raw text of its arguments
written so far, and `done` once its object is closed. A call's `arguments` is the model's own JSON
text (not re-serialised), so the fragments streamed add up to exactly the whole response's value.
"""

from __future__ import annotations

import json
import re
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from lmi_serve import json_body
from lmi_serve.json_body import InvalidJson

# The layout the grammar enforces inside embedded JSON (see engine/sampling/grammar.py).
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_DECODER = json.JSONDecoder()
NO_TOKENS: Mapping[str, int] = MappingProxyType({})  # every marker as text
_STRING = r'"(?:[^"\\]|\\.)*"'


@dataclass
class Call:
    name: str
    arguments: str  # JSON text of an object; a prefix of it while not `done`
    done: bool = False


@dataclass
class Scan:
    """The calls in a text (or its prefix) and whether the text is exactly whole calls."""

    calls: list[Call] = field(default_factory=list)
    complete: bool = False


def skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def expect(text: str, pos: int, literal: str) -> int | None:
    """Position after `literal` at `pos`; None when the text ends inside it or differs (either
    way no further call can be read yet)."""
    return pos + len(literal) if text.startswith(literal, pos) else None


def json_call(text: str, pos: int, keys: tuple[str, ...]) -> tuple[Call | None, int | None]:
    """The call object `{"name": ..., "<key>": {...}, ...}` at `pos` (name first, as the grammar
    writes it): (call so far, end of the object once closed). (None, None) when no name is
    readable yet or the text is not such an object; other keys after the arguments are allowed
    (Mistral's history writes an `id` there)."""
    head = re.compile(r'\{\s*"name"\s*:\s*(' + _STRING + r')\s*,\s*"(?:' + "|".join(keys) + r')"\s*:\s*')
    match = head.match(text, pos)
    if match is None:
        return None, None
    name, start = json.loads(match.group(1)), match.end()
    try:
        value, end = _DECODER.raw_decode(text, start)
    except ValueError:  # the arguments are still being written: all of the rest is theirs
        return Call(name, text[start:]), None
    if not isinstance(value, dict):
        return None, None
    try:
        whole, close = _DECODER.raw_decode(text, pos)
    except ValueError:
        return Call(name, text[start:end]), None
    if not isinstance(whole, dict) or whole.get("name") != name:
        return None, None
    return Call(name, text[start:end], done=True), close


def json_array_calls(text: str, pos: int | None, keys: tuple[str, ...] = ("arguments",)) -> Scan:
    """A JSON array of call objects (`[{"name": ..., "arguments": {...}}, ...]`) opening at `pos`
    (None: no array there): complete when the array is closed and nothing but space follows."""
    scan = Scan()
    pos = expect(text, pos, "[") if pos is not None else None
    while pos is not None:
        call, end = json_call(text, skip_space(text, pos), keys)
        if call is None:
            return scan
        scan.calls.append(call)
        if end is None:
            return scan
        pos = skip_space(text, end)
        if text.startswith("]", pos):
            scan.complete = skip_space(text, pos + 1) == len(text)
            return scan
        pos = expect(text, pos, ",")
    return scan


def arguments_value(arguments):
    """A call's arguments from a request as JSON: the decoded string, or, when it does not
    decode (OpenAI accepts any string there, e.g. a model's broken output replayed), the string."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return json_body.loads(arguments)  # bounded depth: the body's limit does not reach inside strings
    except InvalidJson:
        return arguments


def call_schema(tools, key: str) -> dict:
    """One call object per tool: the name as a constant, then its parameters under `key`."""
    options = [{"type": "object",
                "properties": {"name": {"const": t.function.name},
                               key: t.function.parameters or {"type": "object", "properties": {}}},
                "required": ["name", key], "additionalProperties": False}
               for t in tools]
    return {"anyOf": options, "x-guidance": LAYOUT}


def marker(text: str, tokens: Mapping[str, int]) -> str:
    """A call marker in Lark: the model's own token where the tokenizer holds the marker as one added
    token (`tokens`), else the quoted text. llguidance treats added tokens as special: a quoted
    string never matches them, so under a quoted marker the model would have to spell it out in
    ordinary tokens, which it was never trained to do. `<[id]>` names a token by its id."""
    token_id = tokens.get(text)
    return f"<[{token_id}]>" if token_id is not None else json.dumps(text)


_MARKER_TOKENS: "weakref.WeakKeyDictionary[object, dict[str, dict[str, int]]]" = weakref.WeakKeyDictionary()


def _added_vocab(tokenizer) -> dict[str, int]:
    try:
        return dict(tokenizer.get_added_vocab())
    except (AttributeError, TypeError, NotImplementedError):
        return {}


def text_rule(openers: str) -> str:
    """Free text that cannot be read as the start of a call: its first character is none of `openers`."""
    escaped = "".join("\\" + c if c in "[]\\^-/" else c for c in openers)
    return f"TEXT: /[^{escaped}](.|\\n)*/"


class ToolFormat:
    """One family's way of writing tool calls. Subclasses set the class attributes and the methods."""

    name: str = ""
    openers: str = ""  # first visible characters of a call: output starting so is held while streaming
    parallel: bool = True  # whether several calls can be written in one turn
    streams_arguments: bool = True  # arguments are JSON text the model writes, so they stream as written
    markers: tuple[str, ...] = ()  # the marker texts the grammar writes, which a tokenizer may hold as tokens
    reads_markers: bool = False  # the parser needs the markers in the text (else it reads calls without them)
    keeps_special_tokens: bool = False  # the output is decoded with special tokens kept (its markers are some)

    def calls_rules(self, tools, parallel: bool, tokens: Mapping[str, int] = NO_TOKENS) -> list[str]:
        """Lark rules defining `calls`: one call, or several where `parallel` and the format allow.
        `tokens`: the markers to write as the model's own tokens (`marker_tokens`)."""
        raise NotImplementedError

    def answer_rules(self, tokens: Mapping[str, int] = NO_TOKENS) -> tuple[str, list[str]]:
        """(Lark expression written before an answer that is not a call, the rules it uses): nothing
        where an answer is bare text (it then must not start like a call); gpt-oss's final channel."""
        return "", []

    def marker_tokens(self, tokenizer) -> dict[str, int]:
        """The format's markers that `tokenizer` holds as one added token each (Qwen's `<tool_call>`,
        Llama 3's `<|python_tag|>`, Mistral's `[TOOL_CALLS]`): marker -> token id. Where the parser
        needs a marker in the text, a token that decoding drops (special, with the engine's default
        skip_special_tokens) is left out: the grammar then keeps the marker as text."""
        if not self.markers:
            return {}
        try:
            cached = _MARKER_TOKENS.setdefault(tokenizer, {})
        except TypeError:  # not weak-referenceable: found again each time
            cached = {}
        if self.name not in cached:
            added, found = _added_vocab(tokenizer), {}
            for text in self.markers:
                token_id = added.get(text)
                if token_id is None:
                    continue
                if self.reads_markers and tokenizer.decode([token_id], skip_special_tokens=True) != text:
                    continue
                found[text] = token_id
            cached[self.name] = found
        return cached[self.name]

    def scan(self, text: str) -> Scan:
        raise NotImplementedError

    def render_calls(self, calls: list[tuple[str, object]]) -> str:
        """(name, arguments value) pairs as the model writes them, for templates that cannot."""
        raise NotImplementedError

    def instructions(self) -> str:
        """How to write a call, for a system message when the template knows no tools."""
        raise NotImplementedError

    def new_call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def is_call_start(self, text: str) -> bool:
        stripped = text.lstrip()
        return bool(stripped) and stripped[0] in self.openers
