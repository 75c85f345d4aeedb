"""Qwen3-Coder XML calls (vLLM's `qwen3_coder`): one block per call,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

as Qwen3-Coder's template renders its history (blocks follow each other directly). A parameter's
value is written raw, as the template writes it: objects and arrays as JSON, anything else as
Python prints it (a string as it is, `True`, `3`); JSON's `true`/`null` are read too.

Arguments are not JSON as the model writes them, so a call's `arguments` is JSON built from its
parameters: each parameter is added once its `</parameter>` is written, the object closed at
`</function>`, so a stream sends the arguments a parameter at a time and the fragments add up to
the whole response's value. A value that reads as JSON (a number, `true`, an object) is taken as
that value, any other text as a string; under the grammar a string parameter with an enum can only
be one of its values, other strings are free text up to `</parameter>`.

`<tool_call>` / `</tool_call>` are added tokens of Qwen3's tokenizer that decoding keeps; the grammar
names them as those tokens (as text where the tokenizer lacks them or decoding would drop them)."""

from __future__ import annotations

import json
import re

from lmi_serve.dialects.openai.tool_formats.base import LAYOUT, NO_TOKENS, Call, Scan, ToolFormat, marker, skip_space

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>\n?")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?")
_PARAM_END, _FUNCTION_END = "</parameter>", "</function>"
_PYTHON = {"True": True, "False": False, "None": None}


def value_of(raw: str):
    """A parameter's value from its raw text (the newline around it is the layout's, not the value's)."""
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    if text.strip() in _PYTHON:
        return _PYTHON[text.strip()]
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return text if isinstance(value, str) else value  # `"x"` quoted by the model stays its own text


_CLOSE_PARAMETER = json.dumps("\n" + _PARAM_END + "\n")
# A free string value and the tag closing it, ended at the first `</parameter>` (a greedy text
# terminal would never end).
_TEXT_VALUE = "text_value[lazy]: /(.|\\n)*\\n<\\/parameter>\\n/"


def _value_rule(schema: dict) -> str:
    """A parameter's value and closing tag in Lark: an enum of strings as those strings, another
    string as free text, anything else as JSON."""
    enum = schema.get("enum")
    if enum and all(isinstance(v, str) for v in enum):
        return "(" + " | ".join(json.dumps(v) for v in enum) + ") " + _CLOSE_PARAMETER
    if schema.get("type") == "string":
        return "text_value"
    if schema.get("type") == "boolean":  # as the template writes it (Python's spelling)
        return '("True" | "False") ' + _CLOSE_PARAMETER
    return "%json " + json.dumps({**schema, "x-guidance": LAYOUT}) + " " + _CLOSE_PARAMETER


def _arguments_rule(parameters: dict) -> str:
    """Every required parameter, then each optional one or not, in schema order."""
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or ())
    parts = []
    for name, schema in properties.items():
        one = json.dumps(f"<parameter={name}>\n") + " " + _value_rule(schema or {})
        parts.append(one if name in required else f"({one})?")
    return " ".join(parts)


class Qwen3Coder(ToolFormat):
    name = "qwen3_coder"
    openers = "<"
    markers = (OPEN, CLOSE)
    reads_markers = True

    def calls_rules(self, tools, parallel: bool, tokens=NO_TOKENS) -> list[str]:
        functions = " | ".join(json.dumps(f"<function={t.function.name}>\n") + " "
                               + _arguments_rule(t.function.parameters or {}) + ' "</function>"' for t in tools)
        return ["calls: call+" if parallel else "calls: call",
                f'call: {marker(OPEN, tokens)} "\\n" function "\\n" {marker(CLOSE, tokens)}',
                f"function: {functions}", _TEXT_VALUE]

    def scan(self, text: str) -> Scan:
        scan, pos = Scan(), skip_space(text, 0)
        while pos < len(text):
            if not text.startswith(OPEN, pos):
                return scan
            call, pos = self._call(text, skip_space(text, pos + len(OPEN)))
            if call is None:
                return scan
            scan.calls.append(call)
            if pos is None:
                return scan
            pos = skip_space(text, pos)
        scan.complete = bool(scan.calls)
        return scan

    def _call(self, text: str, pos: int) -> tuple[Call | None, int | None]:
        """The call whose `<function=...>` starts at `pos`, and the position after its `</tool_call>`
        (None while it is not written to the end)."""
        head = _FUNCTION.match(text, pos)
        if head is None or (head.end() == len(text) and not text.endswith("\n")):
            return None, None  # the name may still be growing
        arguments, pos = {}, head.end()
        call = Call(head.group(1).strip(), "{")
        while True:
            pos = skip_space(text, pos)
            parameter = _PARAMETER.match(text, pos)
            if parameter is None:
                break
            end = text.find(_PARAM_END, parameter.end())
            if end < 0:
                return call, None
            arguments[parameter.group(1).strip()] = value_of(text[parameter.end():end])
            call.arguments = json.dumps(arguments)[:-1]  # open: more parameters may follow
            pos = end + len(_PARAM_END)
        if not text.startswith(_FUNCTION_END, pos):
            return call, None
        call.arguments, call.done = json.dumps(arguments), True
        close = skip_space(text, pos + len(_FUNCTION_END))
        if not text.startswith(CLOSE, close):
            return call, None
        return call, close + len(CLOSE)

    def render_calls(self, calls) -> str:
        def value(v) -> str:  # as the template writes it: objects and arrays as JSON, the rest as Python
            return json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) else str(v)

        def one(name, args) -> str:
            params = "".join(f"<parameter={k}>\n{value(v)}\n</parameter>\n" for k, v in (args or {}).items())
            return f"{OPEN}\n<function={name}>\n{params}</function>\n{CLOSE}"

        return "\n".join(one(name, args) for name, args in calls)

    def instructions(self) -> str:
        return (f"To call a function, reply with {OPEN}\n<function=<function name>>\n<parameter=<parameter name>>\n"
                f"<value>\n</parameter>\n</function>\n{CLOSE}")
