"""Mistral (7B-Instruct v0.3, the template tested): `[TOOL_CALLS] [{"name": ..., "arguments":
{...}}, ...]`, all of a turn's calls in one JSON array. `[TOOL_CALLS]` is a special token, which
the text usually drops; the parser reads the array with or without it, and the grammar names the
token where the tokenizer has it (as text otherwise). Call ids are 9 letters and
digits, as Mistral's template demands of the history it renders.

Newer Mistral tokenizers (v11+) write `[TOOL_CALLS]name[ARGS]{...}` instead; that spelling is not
handled here."""

from __future__ import annotations

import json
import secrets
import string

from lmi_serve.dialects.openai.tool_formats.base import (NO_TOKENS, Scan, ToolFormat, call_schema, expect, json_call,
                                                         marker, skip_space)

MARKER = "[TOOL_CALLS]"
_ID_ALPHABET = string.ascii_letters + string.digits


class Mistral(ToolFormat):
    name = "mistral"
    openers = "["
    markers = (MARKER,)

    def calls_rules(self, tools, parallel: bool, tokens=NO_TOKENS) -> list[str]:
        more = ' (", " call)*' if parallel else ""
        return [f'calls: {marker(MARKER, tokens)} " [" call{more} "]"',
                f"call: %json {json.dumps(call_schema(tools, 'arguments'))}"]

    def scan(self, text: str) -> Scan:
        scan, pos = Scan(), skip_space(text, 0)
        if text.startswith(MARKER, pos):
            pos = skip_space(text, pos + len(MARKER))
        pos = expect(text, pos, "[")
        while pos is not None:
            call, end = json_call(text, skip_space(text, pos), ("arguments",))
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

    def render_calls(self, calls) -> str:
        return f"{MARKER} " + json.dumps([{"name": name, "arguments": args} for name, args in calls])

    def instructions(self) -> str:
        return (f'To call functions, reply with {MARKER} [{{"name": <function name>, "arguments": <arguments as a '
                "JSON object>}, ...]")

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))
