"""Hermes / Qwen2.5 / Qwen3: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one
block per call (Qwen's template renders its history so, blocks separated by a newline; the reader
takes any whitespace around and between blocks).

Qwen2.5 and Qwen3 hold both markers as added tokens that are not special, so decoding keeps them
and the grammar names them as those tokens. A tokenizer whose markers are special tokens (dropped
from the text by default) gets them as text: the parser needs to see them."""

from __future__ import annotations

import json

from lmi_serve.dialects.openai.tool_formats.base import (NO_TOKENS, Scan, ToolFormat, call_schema, expect, json_call,
                                                         marker, skip_space)

OPEN, CLOSE = "<tool_call>", "</tool_call>"

class Hermes(ToolFormat):
    name = "hermes"
    openers = "<"
    markers = (OPEN, CLOSE)
    reads_markers = True

    def calls_rules(self, tools, parallel: bool, tokens=NO_TOKENS) -> list[str]:
        schema = json.dumps(call_schema(tools, "arguments"))
        # Blocks follow each other directly: with a newline between them allowed, a small model
        # that writes one after a block is then committed to another call, and tends to repeat.
        return ["calls: call+" if parallel else "calls: call",
                f'call: {marker(OPEN, tokens)} "\\n" %json {schema} "\\n" {marker(CLOSE, tokens)}']

    def scan(self, text: str) -> Scan:
        scan, pos = Scan(), skip_space(text, 0)
        while pos < len(text):
            after = expect(text, pos, OPEN)
            if after is None:
                return scan  # a marker still being written, or not a call at all
            call, end = json_call(text, skip_space(text, after), ("arguments",))
            if call is None:
                return scan
            scan.calls.append(call)
            if end is None:
                return scan
            close = expect(text, skip_space(text, end), CLOSE)
            if close is None:
                call.done = False  # the block is not closed yet (or badly)
                return scan
            pos = skip_space(text, close)
        scan.complete = bool(scan.calls)
        return scan

    def render_calls(self, calls) -> str:
        return "\n".join(f"{OPEN}\n{json.dumps({'name': name, 'arguments': args})}\n{CLOSE}" for name, args in calls)

    def instructions(self) -> str:
        return (f'To call a function, reply with {OPEN}\n{{"name": <function name>, "arguments": <arguments as a '
                f"JSON object>}}\n{CLOSE}")
