"""Llama 3.1 / 3.2 (and 3.3) JSON calls: `{"name": ..., "parameters": {...}}`, as the models'
templates ask, optionally after `<|python_tag|>` (usually dropped from the text as a special token).

One call per turn: Meta's templates refuse to render more than one call in a turn, and vLLM's
llama3_json documents parallel calls as unsupported for Llama 3. The grammar therefore allows one
call; the parser still reads `;`-separated calls, the spelling vLLM accepts, from an
unconstrained model. `arguments` is accepted in place of `parameters` when reading.

Where the tokenizer has `<|python_tag|>` as a token (Llama 3.1+), the grammar lets the call open
with it, as the models sometimes do; as text it is not offered (the templates do not ask for it)."""

from __future__ import annotations

import json

from lmi_serve.dialects.openai.tool_formats.base import (NO_TOKENS, Scan, ToolFormat, call_schema, expect, json_call,
                                                         skip_space)

PYTHON_TAG = "<|python_tag|>"


class Llama3Json(ToolFormat):
    name = "llama3_json"
    openers = "{<"
    parallel = False
    markers = (PYTHON_TAG,)

    def calls_rules(self, tools, parallel: bool, tokens=NO_TOKENS) -> list[str]:
        tag = f"<[{tokens[PYTHON_TAG]}]>? " if PYTHON_TAG in tokens else ""
        return [f"calls: {tag}call", f"call: %json {json.dumps(call_schema(tools, 'parameters'))}"]

    def scan(self, text: str) -> Scan:
        scan, pos = Scan(), skip_space(text, 0)
        if text.startswith(PYTHON_TAG, pos):
            pos = skip_space(text, pos + len(PYTHON_TAG))
        while True:
            call, end = json_call(text, pos, ("parameters", "arguments"))
            if call is None:
                return scan
            scan.calls.append(call)
            if end is None:
                return scan
            pos = skip_space(text, end)
            if pos == len(text):
                break
            after = expect(text, pos, ";")
            if after is None:
                return scan
            pos = skip_space(text, after)
        scan.complete = True
        return scan

    def render_calls(self, calls) -> str:
        return "; ".join(json.dumps({"name": name, "parameters": args}) for name, args in calls)

    def instructions(self) -> str:
        return ('To call a function, reply with only {"name": <function name>, "parameters": <arguments as a JSON '
                "object>}")
