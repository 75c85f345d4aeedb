"""gpt-oss calls in OpenAI's harmony format (vLLM's `openai`): a message to `functions.<name>` on
the commentary channel whose body is the arguments' JSON,

    <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>

as gpt-oss's template renders its history (the recipient after the channel name, and
`<|constrain|>json`, are read too). One call per turn: `<|call|>` ends the turn (the template renders
one call per assistant message). The reasoning splitter (dialects/common/harmony.py) passes calls
on in the template's spelling; read on its own, the raw output's analysis messages are skipped.

Every marker is a special token of gpt-oss's tokenizer, so with tools the output is decoded with
special tokens kept, and the grammar names the markers as those tokens. The grammar lets the model
think first (an analysis message), then write the call, or, where text is allowed, a final message;
it ends at the call's closing brace (the model's `<|call|>` is an end-of-sequence token)."""

from __future__ import annotations

import json

from lmi_serve.dialects.common import harmony
from lmi_serve.dialects.openai.tool_formats.base import (LAYOUT, NO_TOKENS, Call, Scan, ToolFormat, marker,
                                                         skip_space)

_MARKERS = (harmony.START, harmony.CHANNEL, harmony.MESSAGE, harmony.END, harmony.CALL)
_DECODER = json.JSONDecoder()


def _analysis(tokens) -> str:
    """An analysis message and the next message's opening, as Lark; its text ends at `<|end|>`."""
    m = {text: marker(text, tokens) for text in _MARKERS}
    if harmony.END in tokens:  # a token: free text cannot contain it
        thought = 'thought: /(.|\\n)*/'
    else:
        thought = 'thought[lazy]: /(.|\\n)*<\\|end\\|>/'
    end = m[harmony.END] if harmony.END in tokens else ""
    return (f'analysis: {m[harmony.CHANNEL]} "analysis" {m[harmony.MESSAGE]} thought {end} {m[harmony.START]} '
            f'"assistant"', thought)


def _parameters(tool) -> dict:
    return {**(tool.function.parameters or {"type": "object", "properties": {}}), "x-guidance": LAYOUT}


class Harmony(ToolFormat):
    name = "openai"
    openers = "<"
    parallel = False
    markers = _MARKERS
    keeps_special_tokens = True

    def calls_rules(self, tools, parallel: bool, tokens=NO_TOKENS) -> list[str]:
        channel, message = marker(harmony.CHANNEL, tokens), marker(harmony.MESSAGE, tokens)
        calls = " | ".join(f'{json.dumps(" to=functions." + t.function.name)} {channel} "commentary json" {message} '
                           f"%json {json.dumps(_parameters(t))}" for t in tools)
        return ["calls: analysis? call", f"call: {calls}", *_analysis(tokens)]

    def answer_rules(self, tokens=NO_TOKENS) -> tuple[str, list[str]]:
        return (f'analysis? {marker(harmony.CHANNEL, tokens)} "final" {marker(harmony.MESSAGE, tokens)}',
                list(_analysis(tokens)))

    def scan(self, text: str) -> Scan:
        scan, pos = Scan(), 0
        while True:
            pos = skip_space(text, pos)
            if text.startswith(harmony.START, pos):
                pos += len(harmony.START)
            if pos == len(text):
                break
            at = text.find(harmony.MESSAGE, pos)
            if at < 0:
                return scan  # a header still being written, or not harmony
            kind, name = harmony.header_kind(text[pos:at])
            body = at + len(harmony.MESSAGE)
            if kind == "reasoning" and harmony.CHANNEL + "analysis" in text[pos:at]:
                end = text.find(harmony.END, body)
                if end < 0:
                    return scan
                pos = end + len(harmony.END)
                continue
            if kind != "call":
                return scan
            call, end = self._arguments(name, text, body)
            if call is None:
                return scan
            scan.calls.append(call)
            if end is None:
                return scan
            pos = end + len(harmony.CALL) if text.startswith(harmony.CALL, end) else end
        scan.complete = bool(scan.calls)
        return scan

    @staticmethod
    def _arguments(name: str, text: str, pos: int) -> tuple[Call | None, int | None]:
        """The call's JSON object at `pos` and where it ends (None while it is being written)."""
        start = skip_space(text, pos)
        if start == len(text):
            return Call(name, ""), None
        if text[start] != "{":
            return None, None
        try:
            value, end = _DECODER.raw_decode(text, start)
        except ValueError:  # still being written: all of the rest is the arguments so far
            return Call(name, text[start:]), None
        return (Call(name, text[start:end], done=True), end) if isinstance(value, dict) else (None, None)

    def render_calls(self, calls) -> str:
        return "".join(f"{harmony.START}{harmony.call_header(name)}{json.dumps(args)}{harmony.CALL}"
                       for name, args in calls)

    def instructions(self) -> str:
        return (f"To call a function, reply with {harmony.START}{harmony.call_header('<function name>')}"
                f"<arguments as a JSON object>{harmony.CALL}")
