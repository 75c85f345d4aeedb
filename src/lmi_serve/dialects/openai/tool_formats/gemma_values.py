"""Gemma 4's value syntax (the arguments of its calls): read into Python values, written as its
template writes them, and as a Lark grammar for a function's parameters.

    {city:<|"|>Paris<|"|>,days:3,ok:true,none:None,opts:{a:[1.5,2]}}

Object keys are bare (`<|"|>`-quoted keys are read too) and written in Jinja `dictsort`'s order
(case ignored); strings sit between `<|"|>` marks and hold anything but the mark; other scalars
are written as Python prints them (`True` as `true`), with no spaces anywhere."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping

from lmi_serve.dialects.openai.tool_formats.base import LAYOUT, NO_TOKENS, marker

QUOTE = '<|"|>'
_LITERALS = {"true": True, "false": False, "True": True, "False": False, "None": None, "null": None}
_BARE = re.compile(r"[^,}\]]*")
_KEY = re.compile(r"[^:{}\[\],<\"]*")  # JSON-quoted keys are not Gemma's


class Incomplete(Exception):
    """The text ends inside the value (more may make it whole)."""


class Invalid(Exception):
    """The text is not a value in Gemma's syntax."""


# ---- reading --------------------------------------------------------------------------------------

def _string(text: str, pos: int) -> tuple[str, int]:
    end = text.find(QUOTE, pos + len(QUOTE))
    if end < 0:
        raise Incomplete
    return text[pos + len(QUOTE):end], end + len(QUOTE)


def _quote_coming(text: str, pos: int) -> bool:
    """Whether the text ends with the start of a `<|"|>` mark at `pos`."""
    return QUOTE.startswith(text[pos:])


def read_value(text: str, pos: int):
    """(value, end) of the value at `pos`."""
    if pos >= len(text) or _quote_coming(text, pos):
        raise Incomplete
    if text.startswith(QUOTE, pos):
        return _string(text, pos)
    if text[pos] == "{":
        return read_object(text, pos)
    if text[pos] == "[":
        return _array(text, pos)
    end = _BARE.match(text, pos).end()
    if end == len(text):
        raise Incomplete  # a number or word may still grow
    word = text[pos:end].strip()
    if word in _LITERALS:
        return _LITERALS[word], end
    try:
        number = json.loads(word)
    except ValueError:
        raise Invalid from None
    if not isinstance(number, (int, float)) or isinstance(number, bool):
        raise Invalid
    return number, end


def _key(text: str, pos: int) -> tuple[str, int]:
    """The key at `pos` and the position after its `:`."""
    if pos >= len(text) or _quote_coming(text, pos):
        raise Incomplete
    if text.startswith(QUOTE, pos):
        key, end = _string(text, pos)
    else:
        end = _KEY.match(text, pos).end()
        if end == len(text):
            raise Incomplete
        key = text[pos:end].strip()
        if not key:
            raise Invalid
    if end >= len(text):
        raise Incomplete
    if text[end] != ":":
        raise Invalid
    return key, end + 1


def _after_item(text: str, pos: int, close: str) -> tuple[bool, int]:
    """After an item: (whether the container closes here, position of the next item or after the close)."""
    if pos >= len(text):
        raise Incomplete
    if text[pos] == ",":
        return False, pos + 1
    if text[pos] == close:
        return True, pos + 1
    raise Invalid


def read_object(text: str, pos: int, seen: Callable[[dict], None] | None = None) -> tuple[dict, int]:
    """(object, end) of the `{...}` at `pos`; `seen(object so far)` after each of its values."""
    result: dict = {}
    pos += 1
    if pos >= len(text):
        raise Incomplete
    if text[pos] == "}":
        return result, pos + 1
    while True:
        key, pos = _key(text, pos)
        result[key], pos = read_value(text, pos)
        if seen is not None:
            seen(result)
        closed, pos = _after_item(text, pos, "}")
        if closed:
            return result, pos


def _array(text: str, pos: int) -> tuple[list, int]:
    result: list = []
    pos += 1
    if pos >= len(text):
        raise Incomplete
    if text[pos] == "]":
        return result, pos + 1
    while True:
        item, pos = read_value(text, pos)
        result.append(item)
        closed, pos = _after_item(text, pos, "]")
        if closed:
            return result, pos


# ---- writing --------------------------------------------------------------------------------------

def sorted_keys(keys) -> list[str]:
    """Keys in the order Jinja's `dictsort` gives them (case ignored)."""
    return sorted(keys, key=str.lower)


def write_value(value) -> str:
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + members(value) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(write_value(v) for v in value) + "]"
    return str(value)  # numbers and None, as Jinja prints them


def members(mapping: dict) -> str:
    """An object's `key:value` pairs, without the braces."""
    return ",".join(f"{key}:{write_value(mapping[key])}" for key in sorted_keys(mapping))


# ---- grammar --------------------------------------------------------------------------------------

_GENERIC = [
    "g_value: g_string | g_number | \"true\" | \"false\" | \"None\" | g_object | g_array",
    "g_object: \"{\" (g_pair (\",\" g_pair)*)? \"}\"",
    "g_pair: G_KEY \":\" g_value",
    "G_KEY: /[A-Za-z_][A-Za-z0-9_]*/",
    "g_array: \"[\" (g_value (\",\" g_value)*)? \"]\"",
    "g_number: %json " + json.dumps({"type": "number", "x-guidance": LAYOUT}),
]


class Grammar:
    """Lark rules for values in Gemma's syntax, by JSON schema; collects the named rules it uses."""

    def __init__(self, tokens: Mapping[str, int] = NO_TOKENS):
        self.quote = marker(QUOTE, tokens)
        # A token mark cannot occur in free text, which then ends at it; a text mark ends a lazy match.
        self._string_rule = ("g_text: /(.|\\n)*/" if QUOTE in tokens
                             else 'g_text[lazy]: /(.|\\n)*<\\|"\\|>/')
        self._rules: dict[str, str] = {}
        self._generic = False

    def rules(self) -> list[str]:
        """The named rules the expressions handed out so far use."""
        out = list(self._rules.values()) + (_GENERIC if self._generic else [])
        if any("g_string" in rule for rule in out):
            out += [f"g_string: {self.string()}", self._string_rule]
        return out

    def string(self) -> str:
        """A free string: the mark, text, the mark (a text mark closes the lazy text rule itself)."""
        return f"{self.quote} g_text {self.quote}" if self.quote.startswith("<[") else f"{self.quote} g_text"

    def _name(self, body: str) -> str:
        name = f"g_v{len(self._rules)}"
        self._rules[name] = f"{name}: {body}"
        return name

    def value(self, schema) -> str:
        """A value matching `schema`, as a Lark expression."""
        schema = schema if isinstance(schema, dict) else {}
        choices = schema.get("enum") if "enum" in schema else ([schema["const"]] if "const" in schema else None)
        if choices is not None:
            return "(" + " | ".join(self._literal(c) for c in choices) + ")"
        alternatives = schema.get("anyOf") or schema.get("oneOf")
        if alternatives:
            return "(" + " | ".join(self.value(s) for s in alternatives) + ")"
        kind = schema.get("type")
        if isinstance(kind, list):
            return "(" + " | ".join(self.value({**schema, "type": k}) for k in kind) + ")"
        if kind == "string":
            return "g_string"
        if kind in ("integer", "number"):
            bounds = {k: schema[k] for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
                      if k in schema}
            return "%json " + json.dumps({"type": kind, **bounds, "x-guidance": LAYOUT})
        if kind == "boolean":
            return '("true" | "false")'
        if kind == "null":
            return '"None"'
        if kind == "array":
            item = self.value(schema["items"]) if isinstance(schema.get("items"), dict) and schema["items"] else None
            item = item or self._any()
            return self._name(f'"[" ({item} ("," {item})*)? "]"')
        if kind == "object" and isinstance(schema.get("properties"), dict) and schema["properties"]:
            return self._name(f'"{{" {self.members(schema)} "}}"')
        return self._any()

    def members(self, schema: dict) -> str:
        """An object's pairs in the template's key order: every required key, each optional one or not."""
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        pairs = [(json.dumps(f"{key}:") + " " + self._name(self.value(properties[key])), key in required)
                 for key in sorted_keys(properties)]

        def rest(start: int) -> str:  # the pairs from `start` on, after an earlier one (each after a comma)
            return " ".join(f'"," {p}' if req else f'("," {p})?' for p, req in pairs[start:])

        firsts = []
        for index, (pair, req) in enumerate(pairs):  # the first pair written: any up to the first required
            firsts.append(f"{pair} {rest(index + 1)}".strip())
            if req:
                return "(" + " | ".join(firsts) + ")"
        return ("(" + " | ".join(firsts) + ")?") if firsts else ""

    def _literal(self, value) -> str:
        if isinstance(value, str):
            return f"{self.quote} {json.dumps(value)} {self.quote}"
        return json.dumps(write_value(value))

    def _any(self) -> str:
        self._generic = True
        return "g_value"
