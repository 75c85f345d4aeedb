"""One batched generation for a fixed set of requests (the dynamic-batch path).

The prompts are left-padded into one prefill; then every step runs one decode forward for the
rows still going. A finished row leaves the KV cache at once and leading columns that are padding
in every remaining row are trimmed, so work shrinks as rows finish. Per-row position ids make
left padding invisible to RoPE, which keeps greedy output independent of the batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from .detokenizer import IncrementalDetokenizer
from .sampling import HeterogeneousSampler
from .types import FinishReason, GenerationRequest, TokenEvent


@dataclass
class Row:
    """Per-request Python state that lives alongside row i of the batch tensors."""

    request: GenerationRequest
    detokenizer: IncrementalDetokenizer
    special_ids: frozenset[int]
    generated: int = 0
    finished: bool = field(default=False)

    def advance(self, token_id: int, logprob: float) -> TokenEvent:
        """Account one chosen token: stop checks and detokenization, in that order."""
        self.generated += 1
        stop = self.request.stop
        special = token_id in self.special_ids
        finish = None
        if token_id in stop.eos_token_ids and not stop.ignore_eos:
            finish, text = FinishReason.EOS_TOKEN, self.detokenizer.flush()
        else:
            text, hit_stop = self.detokenizer.add(token_id)
            if hit_stop:
                finish = FinishReason.STOP_SEQUENCE
            elif self.generated >= stop.max_new_tokens:
                finish = FinishReason.LENGTH
                text += self.detokenizer.flush()
        self.finished = finish is not None
        return TokenEvent(token_id, text, logprob, special, finish)


def eos_token_ids(model, tokenizer) -> frozenset[int]:
    """EOS ids from the generation config (int or list) plus the tokenizer's own."""
    ids: set[int] = set()
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(config_eos, int):
        ids.add(config_eos)
    elif config_eos:
        ids.update(config_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[i, width - len(prompt):] = 1
    return input_ids.to(device), mask.to(device)


def _trim_padding(cache: DynamicCache, mask: torch.Tensor) -> torch.Tensor:
    """Drop leading columns that are padding in every row, from the mask and every cache layer."""
    used = mask.any(dim=0).nonzero()
    first = int(used[0]) if used.numel() else 0
    if first == 0:
        return mask
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, first:]
        layer.values = layer.values[:, :, first:]
    return mask[:, first:]


def generate_static_batch(model, tokenizer, device, requests: Sequence[GenerationRequest]
                          ) -> Iterator[tuple[int, TokenEvent]]:
    """Yield (request index, event) for every generated token until all requests finished.

    Order of operations per step: sample every row -> one loop over rows for stop checks,
    detokenization and events -> drop finished rows -> one decode forward for the rest.
    """
    special_ids = frozenset(tokenizer.all_special_ids)
    rows = [Row(r, IncrementalDetokenizer(tokenizer, r.stop.stop_sequences, r.stop.include_stop_str_in_output),
                special_ids) for r in requests]
    vocab = model.config.vocab_size
    sampler = HeterogeneousSampler([r.sampling for r in requests], device, vocab)
    input_ids, mask = _left_pad([r.prompt_ids for r in requests], tokenizer.pad_token_id, device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    seen = None
    if sampler.needs_seen_tokens:
        seen = torch.zeros((len(rows), vocab), dtype=torch.bool, device=device)
        # Padding columns point at the row's last (real) token: scatter_ with duplicate indices and
        # different values (pad id is often a real token too, e.g. <|im_end|>) is nondeterministic on CUDA.
        seen.scatter_(1, torch.where(mask.bool(), input_ids, input_ids[:, -1:]), True)
    cache = DynamicCache(config=model.config)
    active = list(range(len(rows)))
    with torch.inference_mode():
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                       past_key_values=cache, use_cache=True).logits[:, -1, :]
        next_pos = mask.sum(dim=-1)
        while True:
            token_ids, logprobs = sampler(logits, seen)
            keep = []
            # The one Python loop over rows per step: stop checks, detokenizing and events together.
            for slot, (index, token_id, logprob) in enumerate(zip(active, token_ids, logprobs)):
                event = rows[index].advance(token_id, logprob)
                yield index, event
                if not rows[index].finished:
                    keep.append(slot)
            if not keep:
                return
            if len(keep) < len(active):
                keep_t = torch.tensor(keep, device=device)
                cache.batch_select_indices(keep_t)
                mask, next_pos = mask[keep_t], next_pos[keep_t]
                seen = seen[keep_t] if seen is not None else None
                sampler.filter(keep)
                active = [active[i] for i in keep]
                token_ids = [token_ids[i] for i in keep]
                mask = _trim_padding(cache, mask)
            last = torch.tensor(token_ids, dtype=torch.long, device=device)[:, None]
            if seen is not None:
                seen.scatter_(1, last, True)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            logits = model(input_ids=last, attention_mask=mask, position_ids=next_pos[:, None],
                           past_key_values=cache, use_cache=True).logits[:, -1, :]
            next_pos = next_pos + 1
