"""Constrained decoding: a grammar per row masks the tokens it cannot accept.

llguidance was chosen by measurement (`scripts/bench_grammar.py` on the default tokenizer):
compiling a schema takes ~1 ms and a mask 10-30 us per token, against 6 ms / 3-6 us for xgrammar
(which pulls in the `triton` GPU compiler as a dependency) and 30-70 ms / 2-60 us for outlines-core
(regular languages only: no schema-less JSON object). At 60 ms per decode step all three are noise;
llguidance is the one with no dependencies that covers JSON Schema and context-free grammars.

The tokenizer wrapper takes ~0.4 s to build, so it is made on first use and shared by every row.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import torch

from lmi_serve.engine.types import GuidedDecoding


# One canonical layout: with free whitespace a model (a small one especially) can pad forever.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """The requested grammar or schema is invalid or unsupported."""


class Constraint:
    """One row's grammar state: which tokens may come next, and advancing over the chosen one."""

    def __init__(self, matcher):
        self._matcher = matcher

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)

    def advance(self, token_id: int) -> None:
        if not self._matcher.consume_token(token_id):
            raise GrammarError(f"the grammar rejected token {token_id}: {self._matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """The output is whole: the grammar accepts nothing more (only end of sequence)."""
        return self._matcher.is_stopped()


class GrammarCompiler:
    """Turns a GuidedDecoding into a fresh Constraint for one sequence."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int]):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._lltokenizer = None
        self._lock = threading.Lock()

    def _ll(self):
        with self._lock:
            if self._lltokenizer is None:
                import llguidance.hf

                self._lltokenizer = llguidance.hf.from_tokenizer(
                    self._tokenizer, n_vocab=self._vocab_size, eos_token=self._eos or None)
            return self._lltokenizer

    def constraint(self, guided: GuidedDecoding) -> Constraint:
        import llguidance

        try:
            if guided.json_schema is not None:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(guided.json_schema, overrides=JSON_LAYOUT)
            elif guided.regex is not None:
                grammar = llguidance.LLMatcher.grammar_from_regex(guided.regex)
            else:
                grammar = llguidance.LLMatcher.grammar_from_lark(guided.lark or "")
        except ValueError as exc:
            raise GrammarError(f"invalid schema: {exc}") from None
        matcher = llguidance.LLMatcher(self._ll(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"unsupported grammar: {matcher.get_error()}")
        return Constraint(matcher)


def allowed_tokens(constraints: Sequence[Constraint | None], vocab_size: int,
                   device: torch.device) -> torch.Tensor | None:
    """A [rows, vocab] bool mask on `device` (all True for unconstrained rows), or None when no row is
    constrained. llguidance fills a bitmask in host memory (32 tokens a word); only that bitmask is
    copied to the device (pinned and asynchronous on a GPU: the host does not wait for it), where it
    is unpacked to the vocabulary's width."""
    if all(c is None for c in constraints):
        return None
    device = torch.device(device)
    words = (vocab_size + 31) // 32
    bitmask = torch.full((len(constraints), words), -1, dtype=torch.int32, pin_memory=device.type == "cuda")
    for row, constraint in enumerate(constraints):
        if constraint is not None:
            constraint.fill_mask(bitmask, row)
    bitmask = bitmask.to(device, non_blocking=True)
    bits = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().reshape(len(constraints), words * 32)
    return allowed[:, :vocab_size]
