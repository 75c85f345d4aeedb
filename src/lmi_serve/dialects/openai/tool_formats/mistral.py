"""Mistral (7B-Instruct v0.3, the template tested): `[TOOL_CALLS] [{"name": ..., "arguments":
{...}}, ...]`, all of a turn's calls in one JSON array. `[TOOL_CALLS]` is a special token, which
the text usually drops; the parser reads the array with or without it, and the grammar names the
token where the tokenizer has it (as text otherwise). Call ids are 9 letters and
digits, as Mistral's template demands of the history it renders.

Newer Mistral tokenizers (v11+: Mistral Small 3.2, Devstral, Magistral) write each call as
`[TOOL_CALLS]name[ARGS]{...}` (their templates put `[CALL_ID]<id>` before `[ARGS]` in the history,
which is read too). The reader takes both spellings; the grammar writes v11's where the tokenizer
holds `[ARGS]` as a token. Both markers are special tokens there, so with tools the output is
decoded with special tokens kept (v0.3's array reads the same with or without its marker)."""

from __future__ import annotations

import json
import secrets
import string

from lmi_serve.dialects.openai.tool_formats.base import (LAYOUT, NO_TOKENS, Call, Scan, ToolFormat, call_schema,
                                                         json_array_calls, marker, skip_space)

MARKER, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_DECODER = json.JSONDecoder()
_ID_ALPHABET = string.ascii_letters + string.digits


def _parameters(tool) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _scan_v11(text: str, pos: int) -> Scan:
    """`[TOOL_CALLS]name([CALL_ID]id)?[ARGS]{...}`, one or more, from `pos` (at a marker)."""
    scan = Scan()
    while pos < len(text):
        if not text.startswith(MARKER, pos):
            return scan
        start = pos + len(MARKER)
        args = text.find(ARGS, start)
        if args < 0:
            return scan  # the name (or the marker after it) is still being written
        name = text[start:args].split(CALL_ID)[0].strip()
        begin = skip_space(text, args + len(ARGS))
        if begin == len(text):
            scan.calls.append(Call(name, ""))
            return scan
        try:
            value, end = _DECODER.raw_decode(text, begin)
        except ValueError:
            if text[begin] == "{":
                scan.calls.append(Call(name, text[begin:]))
            return scan
        if not isinstance(value, dict) or not name:
            return scan
        scan.calls.append(Call(name, text[begin:end], done=True))
        pos = skip_space(text, end)
    scan.complete = bool(scan.calls)
    return scan


class Mistral(ToolFormat):
    name = "mistral"
    openers = "["
    markers = (MARKER, ARGS)
    keeps_special_tokens = True

    def calls_rules(self, tools, parallel: bool, tokens=NO_TOKENS) -> list[str]:
        if ARGS in tokens:  # v11+: `[TOOL_CALLS]name[ARGS]{...}` per call
            calls = " | ".join(f"{marker(MARKER, tokens)} {json.dumps(t.function.name)} {marker(ARGS, tokens)} "
                               f"%json {json.dumps({**_parameters(t), 'x-guidance': LAYOUT})}" for t in tools)
            return ["calls: call+" if parallel else "calls: call", f"call: {calls}"]
        more = ' (", " call)*' if parallel else ""
        return [f'calls: {marker(MARKER, tokens)} " [" call{more} "]"',
                f"call: %json {json.dumps(call_schema(tools, 'arguments'))}"]

    def scan(self, text: str) -> Scan:
        pos = skip_space(text, 0)
        if text.startswith(MARKER, pos) and not text.startswith("[", skip_space(text, pos + len(MARKER))):
            return _scan_v11(text, pos)
        if text.startswith(MARKER, pos):
            pos = skip_space(text, pos + len(MARKER))
        return json_array_calls(text, pos)

    def render_calls(self, calls) -> str:
        return f"{MARKER} " + json.dumps([{"name": name, "arguments": args} for name, args in calls])

    def instructions(self) -> str:
        return (f'To call functions, reply with {MARKER} [{{"name": <function name>, "arguments": <arguments as a '
                "JSON object>}, ...]")

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))
