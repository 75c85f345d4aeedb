"""Incremental detokenization that never releases a partial character or part of a stop string.

Byte-level BPE splits multi-byte characters over several tokens, so decoding token by token
would emit U+FFFD. Fast tokenizers use `tokenizers.decoders.DecodeStream` (O(1) per token);
others fall back to decoding the whole sequence and diffing. Released text is held back by
(longest stop string - 1) characters so a stream never shows the start of a stop string; the
concatenated releases therefore equal the final text exactly. Special tokens are left out unless
asked for (`skip_special_tokens=False`).
"""

from __future__ import annotations

from collections.abc import Sequence

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - very old tokenizers
    DecodeStream = None


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop_sequences: Sequence[str] = (), include_stop_str: bool = False, *,
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) \
            if backend is not None and DecodeStream else None
        self._decode_options = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:
            self._decode_options["spaces_between_special_tokens"] = False  # slow tokenizers know it
        # Fast path without spaces between special tokens: id -> bare text of each added token.
        self._bare = _added_tokens(tokenizer) if self._stream and not (skip_special_tokens or
                                                                       spaces_between_special_tokens) else {}
        self._last_special = False
        self._ids: list[int] = []
        self._stops = tuple(s for s in stop_sequences if s)
        self._include_stop = include_stop_str
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""
        self._released = 0
        self.stopped_by: str | None = None  # the stop string that ended the text, once one has

    def _decode_next(self, token_id: int) -> str:
        if self._stream is not None:
            piece = self._stream.step(self._backend, token_id) or ""
            if self._bare:
                bare = self._bare.get(token_id)
                if bare is not None and self._last_special:
                    piece = bare
                self._last_special = bare is not None
            return piece
        self._ids.append(token_id)
        full = self._tokenizer.decode(self._ids, **self._decode_options)
        if full.endswith("\ufffd"):
            return ""  # a character is still incomplete; it is released with a later token
        return full[len(self.text):]

    def add(self, token_id: int, check_stops: bool = True) -> tuple[str, bool]:
        """Feed one token; return (text now safe to release, whether a stop string was reached).
        With `check_stops` False the new text is not searched; a later search finds only stop
        strings that end in text added after it (one straddling the boundary counts)."""
        before = len(self.text)
        self.text += self._decode_next(token_id)
        if self._stops and check_stops:
            hits = [(pos, s) for s in self._stops
                    if (pos := self.text.find(s, max(self._released, before - len(s) + 1))) >= 0]
            if hits:
                pos, stop = min(hits)
                self.stopped_by = stop
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


def _added_tokens(tokenizer) -> dict[int, str]:
    """Every added (special) token's id and text."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {token_id: getattr(token, "content", str(token)) for token_id, token in decoder.items()}
