"""Gemma 4 calls (vLLM's `gemma4`): not JSON but Gemma's own value syntax,

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,opts:{unit:<|"|>C<|"|>,xs:[1.5,2]}}<tool_call|>

as Gemma 4's template renders its history: keys bare and sorted as Jinja's `dictsort` sorts them
(ignoring case), strings between `<|"|>` marks, `true`/`false`, numbers and `None` as Python
prints them, objects and arrays without spaces; calls follow each other directly. The model hands
the turn over with `<|tool_response>`, which may end the text.

Arguments are JSON built from that syntax (gemma_values.py): a call's `arguments` grows a top-level
key at a time as each value is closed, so a stream sends them in pieces that add up to the whole
response's value. The grammar writes the same syntax, each function's keys in the template's order
(required ones always, optional ones or not), string enums as those strings, numbers as JSON
numbers under the schema's bounds, nested objects and arrays by their schema where it has one.

Every marker is a special token of Gemma 4's tokenizer, so with tools the output is decoded with
special tokens kept, and the grammar names the markers as those tokens (as text where a tokenizer
lacks them)."""

from __future__ import annotations

import json
import re

from lmi_serve.dialects.openai.tool_formats import gemma_values as values
from lmi_serve.dialects.openai.tool_formats.base import NO_TOKENS, Call, Scan, ToolFormat, marker, skip_space
from lmi_serve.dialects.openai.tool_formats.gemma_values import QUOTE

OPEN, CLOSE, RESPONSE = "<|tool_call>", "<tool_call|>", "<|tool_response>"
HEAD = OPEN + "call:"
_NAME = re.compile(r"[^\s{}<>:,]+")


class Gemma4(ToolFormat):
    name = "gemma4"
    openers = "<"
    markers = (OPEN, CLOSE, QUOTE)
    keeps_special_tokens = True

    def calls_rules(self, tools, parallel: bool, tokens=NO_TOKENS) -> list[str]:
        grammar = values.Grammar(tokens)
        functions = " | ".join(json.dumps(f"call:{t.function.name}{{") + " "
                               + grammar.members(t.function.parameters or {}) + ' "}"' for t in tools)
        return ["calls: call+" if parallel else "calls: call",
                f"call: {marker(OPEN, tokens)} function {marker(CLOSE, tokens)}",
                f"function: {functions}", *grammar.rules()]

    def scan(self, text: str) -> Scan:
        scan, pos = Scan(), skip_space(text, 0)
        while pos < len(text):
            if text.startswith(RESPONSE, pos) and scan.calls and skip_space(text, pos + len(RESPONSE)) == len(text):
                break  # the model handing the turn over
            if not text.startswith(HEAD, pos):
                return scan
            call, end = self._call(text, pos + len(HEAD))
            if call is None:
                return scan
            scan.calls.append(call)
            if end is None:
                return scan
            pos = skip_space(text, end)
        scan.complete = bool(scan.calls)
        return scan

    @staticmethod
    def _call(text: str, pos: int) -> tuple[Call | None, int | None]:
        """The call whose name starts at `pos`, and the position after its `<tool_call|>` (None while
        not written to there); (None, None) when the name is still growing or the text is no call."""
        brace = text.find("{", pos)
        if brace < 0 or not _NAME.fullmatch(text[pos:brace]):
            return None, None
        call = Call(text[pos:brace], "{")

        def seen(arguments: dict) -> None:  # a top-level value closed: the object so far, left open
            call.arguments = json.dumps(arguments)[:-1]

        try:
            arguments, end = values.read_object(text, brace, seen)
        except values.Incomplete:
            return call, None
        except values.Invalid:
            return None, None
        call.arguments, call.done = json.dumps(arguments), True
        if not text.startswith(CLOSE, end):
            return (call, None) if CLOSE.startswith(text[end:]) else (None, None)
        return call, end + len(CLOSE)

    def render_calls(self, calls) -> str:
        def one(name, args) -> str:
            inside = values.members(args) if isinstance(args, dict) else str(args)  # a string: as the template
            return f"{HEAD}{name}{{{inside}}}{CLOSE}"

        return "".join(one(name, args) for name, args in calls)

    def instructions(self) -> str:
        return (f"To call a function, reply with {HEAD}<function name>{{<key>:<value>,...}}{CLOSE}, keys in "
                f"alphabetical order, each string value between {QUOTE} marks, e.g. {HEAD}f{{a:{QUOTE}text{QUOTE},b:3}}"
                f"{CLOSE}")
