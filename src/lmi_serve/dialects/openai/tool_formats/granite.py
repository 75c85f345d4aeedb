"""IBM Granite 3.x (vLLM's `granite`): `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`, all of
a turn's calls in one JSON array after the marker, as Granite's template asks ("respond only with
<|tool_call|> followed by a JSON list of tools used"). Its template renders no `tool_calls` in the
history (only content), so past calls go into the assistant's content in this spelling.

The reader takes the array with or without the marker (a tokenizer whose marker is special drops it
from the text by default), and the grammar names the marker as the tokenizer's token where it has one."""

from __future__ import annotations

import json

from lmi_serve.dialects.openai.tool_formats.base import (NO_TOKENS, Scan, ToolFormat, call_schema, json_array_calls,
                                                         marker, skip_space)

MARKER = "<|tool_call|>"


class Granite(ToolFormat):
    name = "granite"
    openers = "<["
    markers = (MARKER,)

    def calls_rules(self, tools, parallel: bool, tokens=NO_TOKENS) -> list[str]:
        more = ' (", " call)*' if parallel else ""
        return [f'calls: {marker(MARKER, tokens)} "[" call{more} "]"',
                f"call: %json {json.dumps(call_schema(tools, 'arguments'))}"]

    def scan(self, text: str) -> Scan:
        pos = skip_space(text, 0)
        if text.startswith(MARKER, pos):
            pos = skip_space(text, pos + len(MARKER))
        return json_array_calls(text, pos)

    def render_calls(self, calls) -> str:
        return MARKER + json.dumps([{"name": name, "arguments": args} for name, args in calls])

    def instructions(self) -> str:
        return (f'To call functions, reply with {MARKER}[{{"name": <function name>, "arguments": <arguments as a '
                "JSON object>}, ...]")
