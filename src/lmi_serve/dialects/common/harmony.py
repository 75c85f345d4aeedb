"""OpenAI's harmony format (gpt-oss): the output is messages on channels, not one text.

After the prompt's `<|start|>assistant` the model writes messages such as

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>final<|message|>the answer
    <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}

(the recipient `to=...` may also follow the channel name). Every marker is a special token, so the
text is decoded with special tokens kept. `Splitter` turns that text into (reasoning, content):
analysis messages (and commentary without a recipient, the model's preambles) are reasoning, a
final message's body is content, and a message to `functions.<name>` is passed on to the content
in one canonical spelling (the template's) for the harmony tool format to read as a call. Text
that never opens a message (a model not writing harmony) is all content."""

from __future__ import annotations

import re

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
ENDS = (END, CALL, RETURN)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


def call_header(name: str) -> str:
    """A call's header as gpt-oss's template renders it in the history (after `<|start|>`)."""
    return f"assistant to=functions.{name}{CHANNEL}commentary json{MESSAGE}"


def header_kind(header: str) -> tuple[str, str | None]:
    """("call", function name) / ("reasoning", None) / ("content", None) for a message's header."""
    recipient = _RECIPIENT.search(header)
    channel = _CHANNEL.search(header)
    if recipient and recipient.group(1).startswith("functions."):
        return "call", recipient.group(1)[len("functions."):]
    if recipient or (channel and channel.group(1) in ("analysis", "commentary")):
        return "reasoning", None  # thinking, preambles, and built-in tools (browser, python) not served here
    return "content", None


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could start one of `markers`."""
    best = 0
    for marker in markers:
        for size in range(min(len(text), len(marker) - 1), best, -1):
            if marker.startswith(text[-size:]):
                best = size
                break
    return best


def _may_open(text: str) -> bool:
    """Whether output starting so can still be a harmony message (a header or its start)."""
    text = text.lstrip()
    return any(opening.startswith(text[:len(opening)]) for opening in ("<|", "to=", "assistant"))


class Splitter:
    """One choice's harmony output -> (reasoning, content) pieces; `reasoning_tokens` counts the
    tokens that fell into reasoning messages (their headers included)."""

    def __init__(self):
        self.state = "first"  # first (nothing decided) | header | body | plain
        self.kind = "content"
        self.buffer = ""
        self.reasoning_tokens = 0

    def feed(self, piece: str, *, token: bool = True) -> tuple[str, str]:
        before = (self.state, self.kind)
        reasoning, content = self._feed(piece)
        in_reasoning = before == ("body", "reasoning") or (self.state == "body" and self.kind == "reasoning")
        if token and (reasoning or in_reasoning):
            self.reasoning_tokens += 1
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held once the output has ended: a body's end goes where its message did, a
        header cut short is dropped (no text of its message was written), undecided text is content."""
        held, self.buffer = self.buffer, ""
        if self.state == "header":
            return "", "" if _may_open(held) else held
        return (held, "") if self.state == "body" and self.kind == "reasoning" else ("", held)

    def _feed(self, piece: str) -> tuple[str, str]:
        out = {"reasoning": [], "content": []}
        text, self.buffer = self.buffer + piece, ""
        while text:
            if self.state == "plain":
                out["content"].append(text)
                break
            if self.state == "first" and text.strip() and not _may_open(text):
                self.state = "plain"
                continue
            if self.state in ("first", "header"):
                at = text.find(MESSAGE)
                if at < 0:
                    self.buffer = text
                    break
                self.kind, name = header_kind(text[:at])
                if self.kind == "call":
                    out["content"].append(START + call_header(name))
                text, self.state = text[at + len(MESSAGE):], "body"
                continue
            ends = [(text.find(m), m) for m in ENDS if m in text]
            if ends:
                at, marker = min(ends)
                out[self._to()].append(text[:at] + (CALL if self.kind == "call" else ""))
                text, self.state = text[at + len(marker):], "header"
                continue
            keep = _held(text, ENDS)
            out[self._to()].append(text[:len(text) - keep])
            self.buffer = text[len(text) - keep:]
            break
        return "".join(out["reasoning"]), "".join(out["content"])

    def _to(self) -> str:
        return "reasoning" if self.kind == "reasoning" else "content"  # a call's text is read from the content
