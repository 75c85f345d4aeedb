"""Incremental detokenization that never releases a partial character or part of a stop string.

Byte-level BPE splits multi-byte characters over several tokens, so decoding token by token
would emit U+FFFD. Fast tokenizers use `tokenizers.decoders.DecodeStream` (O(1) per token);
others fall back to decoding the whole sequence and diffing. Released text is held back by
(longest stop string - 1) characters so a stream never shows the start of a stop string; the
concatenated releases therefore equal the final text exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - very old tokenizers
    DecodeStream = None


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop_sequences: Sequence[str] = (), include_stop_str: bool = False):
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=True) if backend is not None and DecodeStream else None
        self._ids: list[int] = []
        self._stops = tuple(s for s in stop_sequences if s)
        self._include_stop = include_stop_str
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""
        self._released = 0

    def _decode_next(self, token_id: int) -> str:
        if self._stream is not None:
            return self._stream.step(self._backend, token_id) or ""
        self._ids.append(token_id)
        full = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        if full.endswith("\ufffd"):
            return ""  # a character is still incomplete; it is released with a later token
        return full[len(self.text):]

    def add(self, token_id: int) -> tuple[str, bool]:
        """Feed one token; return (text now safe to release, whether a stop string was reached)."""
        self.text += self._decode_next(token_id)
        if self._stops:
            hits = [(pos, s) for s in self._stops if (pos := self.text.find(s, self._released)) >= 0]
            if hits:
                pos, stop = min(hits)
                end = pos + len(stop) if self._include_stop else pos
                self.text = self.text[:end]
                return self._release(end), True
        return self._release(len(self.text) - self._hold), False

    def flush(self) -> str:
        """Release everything held back; call once when the sequence ends for another reason."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self._released:
            return ""
        piece = self.text[self._released:upto]
        self._released = upto
        return piece
