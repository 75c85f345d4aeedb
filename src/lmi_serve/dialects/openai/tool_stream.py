"""Streamed tool calls: the `tool_calls` deltas of one choice as its text grows.

OpenAI's shape: a call's first delta carries its index, id, type and name with the arguments
written so far; later deltas carry only further `arguments` fragments. The fragments are slices
of the same scan the whole response is parsed with, so they concatenate to exactly the
non-streamed call's `arguments`. Formats whose arguments are not JSON as written (pythonic) send
each call whole once the output is complete.
"""

from __future__ import annotations

from lmi_serve.dialects.openai.tool_formats import ToolFormat


class ToolCallStream:
    def __init__(self, tool_format: ToolFormat):
        self.format = tool_format
        self._sent: list[int] = []  # per call: how much of its arguments has gone out

    @property
    def started(self) -> bool:
        return bool(self._sent)

    def deltas(self, text: str, final: bool = False) -> list[dict] | None:
        """The deltas `text` adds to what was sent. At the end (`final`): None when the text is not
        wholly calls (cut short, or never a call), so the caller can fall back to content."""
        if not final and not self.format.streams_arguments:
            return []
        scan = self.format.scan(text)
        if final and not (scan.complete and scan.calls):
            return None
        deltas = []
        for index, call in enumerate(scan.calls):
            if index == len(self._sent):
                deltas.append({"index": index, "id": self.format.new_call_id(), "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
                self._sent.append(len(call.arguments))
            elif len(call.arguments) > self._sent[index]:
                deltas.append({"index": index, "function": {"arguments": call.arguments[self._sent[index]:]}})
                self._sent[index] = len(call.arguments)
        return deltas
