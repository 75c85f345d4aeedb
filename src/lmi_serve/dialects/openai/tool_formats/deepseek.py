"""DeepSeek's tool tokens, in two spellings (vLLM's `deepseek_v3` and `deepseek_v31`):

    V3 / R1:  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
              ```json
              {"city": "Paris"}
              ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    V3.1:     <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

as their templates render the history (V3/R1 put a newline between calls, V3.1 none; the reader
takes whitespace between them). The arguments are the JSON the model writes, so they stream as
written. The markers are added tokens that are not special in DeepSeek's tokenizers: decoding
keeps them and the grammar names them as those tokens (as text where a tokenizer lacks them).

Both templates join a past call's `arguments` to text with `+`, so they need it as a string
(chat.template_messages passes the request's own string to such templates)."""

from __future__ import annotations

import json

from lmi_serve.dialects.openai.tool_formats.base import LAYOUT, NO_TOKENS, Call, Scan, ToolFormat, marker, skip_space

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_FENCE_OPEN, _FENCE_CLOSE = "\n```json\n", "\n```"
_DECODER = json.JSONDecoder()


def _parameters(tool) -> str:
    return json.dumps({**(tool.function.parameters or {"type": "object", "properties": {}}), "x-guidance": LAYOUT})


def _arguments(name: str, text: str, pos: int) -> tuple[Call | None, int | None]:
    """The JSON object at `pos` as the call's arguments, and where it ends (None while being written)."""
    if pos >= len(text):
        return Call(name, ""), None
    if text[pos] != "{":
        return None, None
    try:
        value, end = _DECODER.raw_decode(text, pos)
    except ValueError:  # still being written: the rest is the arguments so far
        return Call(name, text[pos:]), None
    return (Call(name, text[pos:end], done=True), end) if isinstance(value, dict) else (None, None)


class _DeepSeek(ToolFormat):
    openers = "<"
    markers = (CALLS_BEGIN, CALL_BEGIN, SEP, CALL_END, CALLS_END)
    reads_markers = True
    between = ""  # what the template writes between two calls

    def _call(self, text: str, pos: int) -> tuple[Call | None, int | None]:
        """The call after a `<｜tool▁call▁begin｜>` ending at `pos` and the position after its
        `<｜tool▁call▁end｜>` (None while not written to there)."""
        raise NotImplementedError

    def _call_rule(self, tool, tokens) -> str:
        raise NotImplementedError

    def calls_rules(self, tools, parallel: bool, tokens=NO_TOKENS) -> list[str]:
        more = f' ({json.dumps(self.between) + " " if self.between else ""}call)*' if parallel else ""
        return [f"calls: {marker(CALLS_BEGIN, tokens)} call{more} {marker(CALLS_END, tokens)}",
                "call: " + " | ".join(self._call_rule(t, tokens) for t in tools)]

    def scan(self, text: str) -> Scan:
        scan, pos = Scan(), skip_space(text, 0)
        if not text.startswith(CALLS_BEGIN, pos):
            return scan
        pos = skip_space(text, pos + len(CALLS_BEGIN))
        while text.startswith(CALL_BEGIN, pos):
            call, end = self._call(text, pos + len(CALL_BEGIN))
            if call is None:
                return scan
            scan.calls.append(call)
            if end is None:
                return scan
            pos = skip_space(text, end)
        # Whole once the calls are closed (the model's `<｜tool▁calls▁end｜>`, or the text's end).
        if text.startswith(CALLS_END, pos):
            pos = skip_space(text, pos + len(CALLS_END))
        scan.complete = bool(scan.calls) and pos == len(text)
        return scan

    def _close(self, call: Call, text: str, pos: int) -> int | None:
        """After the arguments: the call's end marker (a call not closed so is not done)."""
        if not text.startswith(CALL_END, pos):
            call.done = False
            return None
        return pos + len(CALL_END)

    def instructions(self) -> str:
        example = self.render_calls([("<function name>", {})]).replace("{}", "<arguments as a JSON object>")
        return f"To call a function, reply with {example}"


class DeepSeekV3(_DeepSeek):
    """DeepSeek-V3 / R1: `function<｜tool▁sep｜>name` then the arguments in a ```json fence."""

    name = "deepseek_v3"
    between = "\n"

    def _call(self, text: str, pos: int) -> tuple[Call | None, int | None]:
        head = "function" + SEP
        if not text.startswith(head, pos):
            return None, None
        line = text.find("\n", pos + len(head))
        if line < 0:
            return None, None  # the name may still be growing
        name = text[pos + len(head):line].strip()
        if not text.startswith(_FENCE_OPEN, line):
            return None, None
        call, end = _arguments(name, text, line + len(_FENCE_OPEN))
        if call is None or end is None:
            return call, None
        if not text.startswith(_FENCE_CLOSE, end):
            call.done = False
            return call, None
        return call, self._close(call, text, end + len(_FENCE_CLOSE))

    def _call_rule(self, tool, tokens) -> str:
        return (f'{marker(CALL_BEGIN, tokens)} "function" {marker(SEP, tokens)} '
                f"{json.dumps(tool.function.name + _FENCE_OPEN)} %json {_parameters(tool)} "
                f"{json.dumps(_FENCE_CLOSE)} {marker(CALL_END, tokens)}")

    def render_calls(self, calls) -> str:
        return CALLS_BEGIN + self.between.join(
            f"{CALL_BEGIN}function{SEP}{name}{_FENCE_OPEN}{json.dumps(args)}{_FENCE_CLOSE}{CALL_END}"
            for name, args in calls) + CALLS_END


class DeepSeekV31(_DeepSeek):
    """DeepSeek-V3.1: `name<｜tool▁sep｜>` then the arguments' JSON."""

    name = "deepseek_v31"

    def _call(self, text: str, pos: int) -> tuple[Call | None, int | None]:
        sep = text.find(SEP, pos)
        if sep < 0:
            return None, None  # the name (or the separator) is still being written
        name = text[pos:sep].strip()
        if not name or any(m in name for m in self.markers):
            return None, None
        call, end = _arguments(name, text, sep + len(SEP))
        if call is None or end is None:
            return call, None
        return call, self._close(call, text, end)

    def _call_rule(self, tool, tokens) -> str:
        return (f"{marker(CALL_BEGIN, tokens)} {json.dumps(tool.function.name)} {marker(SEP, tokens)} "
                f"%json {_parameters(tool)} {marker(CALL_END, tokens)}")

    def render_calls(self, calls) -> str:
        return CALLS_BEGIN + "".join(f"{CALL_BEGIN}{name}{SEP}{json.dumps(args)}{CALL_END}"
                                     for name, args in calls) + CALLS_END
