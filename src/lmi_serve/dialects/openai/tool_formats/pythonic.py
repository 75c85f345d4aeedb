"""Pythonic calls (Llama 3.2 / Llama 4 pythonic templates, vLLM's `pythonic`): a Python list of
calls with keyword arguments, `[get_weather(city="Paris"), get_time()]`.

The text is Python, not JSON, so arguments cannot be passed on as the model writes them: a call's
`arguments` is the JSON of its literal values, known once the list is closed, and a stream sends
each call whole at the end. The grammar writes values as JSON literals (the schema of each
parameter holds them), so the reader accepts `true`/`false`/`null` beside Python's spellings;
under the grammar required parameters come first, then any optional ones, in schema order."""

from __future__ import annotations

import ast
import json

from lmi_serve.dialects.openai.tool_formats.base import LAYOUT, NO_TOKENS, Call, Scan, ToolFormat
from lmi_serve.errors import InvalidRequest

_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


class _NotLiteral(ValueError):
    pass


def _literal(node: ast.AST):
    """A Python (or JSON) literal's value; anything else (a variable, an expression) is refused."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict) and all(key is not None for key in node.keys):
        return {str(_literal(k)): _literal(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
            and isinstance(node.operand.value, (int, float)) and not isinstance(node.operand.value, bool):
        return -node.operand.value
    raise _NotLiteral(ast.dump(node))


def _python(value) -> str:
    """A JSON value written as a Python literal."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a Python string literal too
    if isinstance(value, list):
        return "[" + ", ".join(_python(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {_python(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def _arguments_rule(parameters: dict) -> str:
    """Keyword arguments: every required parameter, then each optional one or not (kwargs' order
    carries no meaning in Python, so one fixed order loses nothing)."""
    properties = parameters.get("properties") or {}
    required = [p for p in properties if p in set(parameters.get("required") or ())]
    optional = [p for p in properties if p not in required]

    def kwarg(name: str) -> str:
        return f'"{name}=" %json {json.dumps({**properties[name], "x-guidance": LAYOUT})}'

    if required:
        head = ' ", " '.join(kwarg(p) for p in required)
        return " ".join([head] + [f'(", " {kwarg(p)})?' for p in optional])
    if not optional:
        return ""
    # None required: the first one written opens the list, any later ones follow it.
    choices = [" ".join([kwarg(p)] + [f'(", " {kwarg(q)})?' for q in optional[i + 1:]]) for i, p in enumerate(optional)]
    return "(" + " | ".join(choices) + ")?"


class Pythonic(ToolFormat):
    name = "pythonic"
    openers = "["
    streams_arguments = False

    def calls_rules(self, tools, parallel: bool, tokens=NO_TOKENS) -> list[str]:
        alternatives = []
        for index, tool in enumerate(tools):
            # A call is Python: a name or keyword that is no identifier (`get-weather`) cannot be written.
            names = [tool.function.name, *((tool.function.parameters or {}).get("properties") or {})]
            for name in names:
                if not (isinstance(name, str) and name.isidentifier()):
                    raise InvalidRequest(f"tools[{index}]: {name!r} is not a Python identifier, which this model's "
                                         "pythonic tool calls need for function and parameter names", param="tools")
            arguments = _arguments_rule(tool.function.parameters or {})
            alternatives.append(f'"{tool.function.name}(" {arguments} ")"'.replace("  ", " "))
        more = ' (", " call)*' if parallel else ""
        return [f'calls: "[" call{more} "]"', "call: " + " | ".join(alternatives)]

    def scan(self, text: str) -> Scan:
        stripped = text.strip()
        if not (stripped.startswith("[") and stripped.endswith("]")):
            return Scan()
        try:
            tree = ast.parse(stripped, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return Scan()
        if not isinstance(tree, ast.List) or not tree.elts:
            return Scan()
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args) \
                    or any(k.arg is None for k in node.keywords):
                return Scan()
            try:
                arguments = {k.arg: _literal(k.value) for k in node.keywords}
            except (_NotLiteral, RecursionError):
                return Scan()
            calls.append(Call(node.func.id, json.dumps(arguments), done=True))
        return Scan(calls, complete=True)

    def render_calls(self, calls) -> str:
        def one(name, args) -> str:
            pairs = args.items() if isinstance(args, dict) else ()
            return f"{name}(" + ", ".join(f"{k}={_python(v)}" for k, v in pairs) + ")"

        return "[" + ", ".join(one(name, args) for name, args in calls) + "]"

    def instructions(self) -> str:
        return "To call functions, reply with only [function_name(parameter=value, ...), ...]"
