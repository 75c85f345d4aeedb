"""A batch of sequences being generated together: tensors, KV cache, and per-row Python state.

Row i of every tensor (cache, mask, positions, last token, token history) and of the sampler is
`rows[i]`. Three verbs change the set of rows: `Batch.prefill` (new rows), `filter` (rows leave)
and `concatenate` (two batches become one). Left padding plus per-row position ids keep padding
invisible to the model, so a row's greedy output does not depend on its neighbours.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from .detokenizer import IncrementalDetokenizer
from .grammar import Constraint
from .sampling import HeterogeneousSampler, SampleOutput
from .token_masks import token_mask
from .types import FinishReason, GenerationRequest, TokenEvent, TopToken


@dataclass
class Row:
    """Per-request Python state that lives alongside row i of the batch tensors."""

    request: GenerationRequest
    detokenizer: IncrementalDetokenizer
    token_text: Callable[[int], str]
    special_ids: frozenset[int]
    owner: Any = None  # whoever receives this row's events (the engine's RequestHandle)
    generated: int = 0
    finished: bool = False
    prompt_tokens: tuple[TopToken, ...] | None = None  # sent with the first event
    prompt_top_tokens: tuple[tuple[TopToken, ...], ...] | None = None  # sent with the first event
    constraint: Constraint | None = None  # the row's grammar, when its output is constrained
    token_ids: list[int] = field(default_factory=list)  # generated so far (banned sequences look back)

    def advance(self, token_id: int, logprob: float, top: list[tuple[int, float]]) -> TokenEvent:
        """Account one chosen token: stop checks and detokenization, in that order."""
        self.generated += 1
        self.token_ids.append(token_id)
        stop = self.request.stop
        finish = None
        if (token_id in stop.eos_token_ids and not stop.ignore_eos) or token_id in stop.stop_token_ids:
            finish, text = FinishReason.EOS_TOKEN, self.detokenizer.flush()
        else:
            if self.constraint is not None:
                try:
                    self.constraint.advance(token_id)
                except ValueError as exc:  # cannot happen under the mask; if it does, end this row only
                    self.finished = True
                    return TokenEvent(token_id, "", logprob, False, FinishReason.ERROR, error=str(exc))
            text, hit_stop = self.detokenizer.add(token_id, check_stops=self.generated > stop.min_new_tokens)
            if hit_stop:
                finish = FinishReason.STOP_SEQUENCE
            elif self.constraint is not None and self.constraint.complete:
                # The grammar allows nothing but the end: finish now instead of spending a step on EOS.
                finish = FinishReason.EOS_TOKEN
                text += self.detokenizer.flush()
            elif self.generated >= stop.max_new_tokens:
                finish = FinishReason.LENGTH
                text += self.detokenizer.flush()
        self.finished = finish is not None
        alternatives = tuple(TopToken(t, self.token_text(t), lp, t in self.special_ids) for t, lp in top)
        prompt, self.prompt_tokens = self.prompt_tokens, None
        prompt_top, self.prompt_top_tokens = self.prompt_top_tokens, None
        return TokenEvent(token_id, text, logprob, token_id in self.special_ids, finish, alternatives, prompt,
                          prompt_top_tokens=prompt_top)


def make_row(request: GenerationRequest, tokenizer, owner: Any = None, constraint: Constraint | None = None) -> Row:
    options = request.detokenize
    detokenizer = IncrementalDetokenizer(tokenizer, request.stop.stop_sequences,
                                         request.stop.include_stop_str_in_output,
                                         skip_special_tokens=options.skip_special_tokens,
                                         spaces_between_special_tokens=options.spaces_between_special_tokens)
    return Row(request, detokenizer, lambda t: tokenizer.decode([t]), frozenset(tokenizer.all_special_ids), owner,
               constraint=constraint)


def _left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[i, width - len(prompt):] = 1
    return input_ids.to(device), mask.to(device)


def _prompt_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor, row: Row) -> None:
    """Set `row.prompt_tokens`: each prompt token's logprob and rank given the tokens before it (the
    first has neither), and with `prompt_top_n` each position's best alternatives."""
    start = int(mask.shape[0] - mask.sum())
    ids = input_ids[start:]
    all_logprobs = torch.log_softmax(logits[start:-1].float(), dim=-1)
    picked = all_logprobs.gather(1, ids[1:, None])
    ranks = [None, *((all_logprobs > picked).sum(dim=-1) + 1).tolist()]
    values = [None, *picked.squeeze(1).tolist()]
    row.prompt_tokens = tuple(TopToken(t, row.token_text(t), lp, t in row.special_ids, rank)
                              for t, lp, rank in zip(ids.tolist(), values, ranks))
    n = row.request.prompt_top_n
    if n:
        best, best_ids = torch.topk(all_logprobs, min(n, all_logprobs.shape[-1]), dim=-1)
        row.prompt_top_tokens = ((), *(
            tuple(TopToken(t, row.token_text(t), lp, t in row.special_ids, rank + 1)
                  for rank, (t, lp) in enumerate(zip(position_ids, position_lps)))
            for position_ids, position_lps in zip(best_ids.tolist(), best.tolist())))


@dataclass
class Batch:
    rows: list[Row]
    cache: DynamicCache
    mask: torch.Tensor  # [rows, cached length + pending]: 1 for real tokens
    next_pos: torch.Tensor  # [rows]: position id of the pending token
    last: torch.Tensor  # [rows]: the pending token, fed to the next decode forward
    seen: torch.Tensor  # [rows, vocab] bool: prompt + generated tokens (repetition penalty)
    counts: torch.Tensor  # [rows, vocab] int: generated-token counts (presence/frequency)
    sampler: HeterogeneousSampler
    logits: torch.Tensor | None = field(default=None, repr=False)  # of the last forward, not yet sampled

    def __len__(self) -> int:
        return len(self.rows)

    @classmethod
    def prefill(cls, model, rows: list[Row], pad_id: int, device) -> "Batch":
        """One left-padded forward over the prompts of `rows`; leaves logits ready to sample."""
        requests = [r.request for r in rows]
        input_ids, mask = _left_pad([r.prompt_ids for r in requests], pad_id, device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=model.config)
        want_prompt = any(r.prompt_logprobs for r in requests)
        with torch.inference_mode():
            out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                        use_cache=True, logits_to_keep=0 if want_prompt else 1)
        for i, row in enumerate(rows):
            if row.request.prompt_logprobs:
                _prompt_logprobs(out.logits[i], input_ids[i], mask[i], row)
        vocab = out.logits.shape[-1]
        seen = torch.zeros((len(rows), vocab), dtype=torch.bool, device=device)
        # Padding columns point at the row's last real token, so only real tokens are marked.
        seen.scatter_(1, torch.where(mask.bool(), input_ids, input_ids[:, -1:]), True)
        sampler = HeterogeneousSampler([r.sampling for r in requests], device, vocab,
                                       top_n=[r.top_n_tokens for r in requests])
        return cls(rows, cache, mask, mask.sum(dim=-1), input_ids[:, -1], seen,
                   torch.zeros((len(rows), vocab), dtype=torch.int32, device=device), sampler,
                   out.logits[:, -1, :])

    def decode(self, model) -> None:
        """One forward feeding every row its pending token."""
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        with torch.inference_mode():
            out = model(input_ids=self.last[:, None], attention_mask=self.mask, position_ids=self.next_pos[:, None],
                        past_key_values=self.cache, use_cache=True)
        self.next_pos = self.next_pos + 1
        self.logits = out.logits[:, -1, :]

    def sample(self) -> SampleOutput:
        """Choose each row's next token from the last forward and record it as pending."""
        history = self.sampler.needs_token_history
        allowed = token_mask(self.rows, self.logits.shape[-1], self.logits.device)
        choice = self.sampler(self.logits, self.seen if history else None, self.counts if history else None,
                              allowed)
        self.logits = None
        self.last = torch.tensor(choice.token_ids, dtype=torch.long, device=self.mask.device)
        self.seen.scatter_(1, self.last[:, None], True)
        self.counts.scatter_add_(1, self.last[:, None], torch.ones_like(self.counts[:, :1]))
        return choice

    def filter(self, keep: Sequence[int]) -> None:
        """Keep only the rows at `keep`; drop leading columns that became padding in every row."""
        if list(keep) == list(range(len(self.rows))):
            return
        index = torch.tensor(list(keep), dtype=torch.long, device=self.mask.device)
        self.rows = [self.rows[i] for i in keep]
        self.cache.batch_select_indices(index)
        for name in ("mask", "next_pos", "last", "seen", "counts"):
            setattr(self, name, getattr(self, name)[index])
        self.sampler.filter(keep)
        used = self.mask.any(dim=0).nonzero()
        first = int(used[0]) if used.numel() else 0
        if first:
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
            self.mask = self.mask[:, first:]

    def concatenate(self, other: "Batch") -> None:
        """Append `other`'s rows, left-padding whichever cache is shorter."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        layers = []
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            keys = [F.pad(t, (0, 0, width - t.shape[2], 0)) for t in (mine.keys, theirs.keys)]
            values = [F.pad(t, (0, 0, width - t.shape[2], 0)) for t in (mine.values, theirs.values)]
            layers.append((torch.cat(keys), torch.cat(values)))
        for layer, (keys, values) in zip(self.cache.layers, layers):
            layer.keys, layer.values = keys, values
        self.mask = torch.cat([F.pad(m, (width - m.shape[1], 0)) for m in (self.mask, other.mask)])
        self.rows += other.rows
        for name in ("next_pos", "last", "seen", "counts"):
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        self.sampler.extend(other.sampler)

    def emit(self, choice: SampleOutput) -> list[tuple[Row, TokenEvent]]:
        """Advance every row by its chosen token: the one Python loop over rows per step
        (stop checks, detokenization and event building together)."""
        return [(row, row.advance(token, logprob, top))
                for row, token, logprob, top in zip(self.rows, choice.token_ids, choice.logprobs, choice.top)]

    def evict_finished(self) -> None:
        self.filter([i for i, row in enumerate(self.rows) if not row.finished])
