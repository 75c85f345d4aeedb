"""Automatic prefix caching (`option.enable_prefix_caching`): requests that share a prompt prefix
(a chat template's system prompt, few-shot examples, the earlier turns of a chat) reuse its K/V.

A prompt is cut into blocks of `block_tokens` tokens. A block is known by its tokens and by the block
before it, so it matches only where the whole prefix up to it matches. After a prefill, the scheduler
stores the prompt's full blocks (each layer's K/V for those positions, copied out of the batch);
a later prompt takes the longest chain of stored blocks that still leaves at least one of its own
tokens to prefill (the forward over that token gives the logits of the first generated one), starts
a row from their K/V (the KV layout's `resume`, where it `supports_prefixes`) and prefills only the
rest (`prefill_more`, as a chunked prefill does).

Exact: a block's K/V are what a prefill computes for the same tokens at the same positions, and the
rest attends to them as it would in one forward; only the float rounding of differently shaped
matrix products differs, as it does between batch sizes, and greedy outputs stay the same (tests).

Memory is bounded by `budget_bytes`. A block is referenced by the blocks stored after it and by
the prefills reading it; to make room, the least recently used block that nothing references goes.
When nothing can go, a new block is simply not stored.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from lmi_serve.engine.kv.protocol import KVBatch, KVLayout

LayerKV = tuple[torch.Tensor, torch.Tensor] | None  # one layer's K and V, or None (a layer that keeps none)
BLOCK_TOKENS = 16


@dataclass(eq=False)
class Block:
    """One stored block: every layer's K/V ([kv heads, block_tokens, head dim]) for its tokens."""

    id: int
    parent: Block | None
    tokens: tuple[int, ...]
    kv: list[LayerKV] = field(repr=False)
    nbytes: int
    children: int = 0  # stored blocks whose parent this is
    readers: int = 0  # prefills holding it (`acquire` .. `release`)

    @property
    def key(self) -> tuple[int, tuple[int, ...]]:
        return _key(self.parent, self.tokens)


def _key(parent: Block | None, tokens: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    return (parent.id if parent is not None else 0, tokens)


@dataclass
class PrefixStats:
    lookups: int = 0  # prompts looked up
    hits: int = 0  # of those, prompts that reused at least one block
    prompt_tokens: int = 0  # tokens of the prompts looked up
    hit_tokens: int = 0  # of those, tokens whose K/V came from the cache
    stored_blocks: int = 0
    evicted_blocks: int = 0
    blocks: int = 0  # held now
    bytes: int = 0  # held now


class PrefixCache:
    def __init__(self, budget_bytes: int, block_tokens: int = BLOCK_TOKENS):
        if block_tokens < 1 or budget_bytes < 0:
            raise ValueError("a prefix cache needs block_tokens >= 1 and budget_bytes >= 0")
        self.budget_bytes, self.block_tokens = budget_bytes, block_tokens
        self._blocks: collections.OrderedDict[tuple, Block] = collections.OrderedDict()  # least recent first
        self._ids = itertools.count(1)
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def nbytes(self) -> int:
        return self.stats.bytes

    def _blocks_of(self, tokens: Sequence[int], count: int):
        size = self.block_tokens
        return (tuple(tokens[i * size:(i + 1) * size]) for i in range(count))

    def lookup(self, prompt: Sequence[int]) -> list[Block]:
        """The longest chain of stored blocks that `prompt` starts with and that leaves at least one
        prompt token over. Changes nothing (see `acquire`)."""
        chain: list[Block] = []
        parent = None
        for tokens in self._blocks_of(prompt, (len(prompt) - 1) // self.block_tokens):
            block = self._blocks.get(_key(parent, tokens))
            if block is None:
                break
            chain.append(block)
            parent = block
        return chain

    def cached_tokens(self, prompt: Sequence[int]) -> int:
        """How many of `prompt`'s first tokens a prefill could take from here."""
        return len(self.lookup(prompt)) * self.block_tokens

    def count(self, prompt_tokens: int, hit_tokens: int) -> None:
        """Count one prefill of a prompt of `prompt_tokens` tokens, `hit_tokens` of them from here."""
        self.stats.lookups += 1
        self.stats.prompt_tokens += prompt_tokens
        self.stats.hits += hit_tokens > 0
        self.stats.hit_tokens += hit_tokens

    def acquire(self, prompt: Sequence[int]) -> list[Block]:
        """`lookup`, and the chain held (not evicted) until `release`."""
        chain = self.lookup(prompt)
        for block in chain:
            block.readers += 1
            self._blocks.move_to_end(block.key)
        return chain

    def release(self, chain: Sequence[Block]) -> None:
        for block in chain:
            block.readers -= 1

    @staticmethod
    def prefix_kv(chain: Sequence[Block]) -> list[LayerKV]:
        """Per layer, the chain's K/V as one row: [1, kv heads, tokens, head dim] each."""
        layers = []
        for parts in zip(*(block.kv for block in chain)):
            if parts[0] is None:
                layers.append(None)
                continue
            layers.append((torch.cat([k for k, _ in parts], dim=1)[None],
                           torch.cat([v for _, v in parts], dim=1)[None]))
        return layers

    def store(self, prompt: Sequence[int], kv_of: Callable[[int, int], list[LayerKV]]) -> int:
        """Store `prompt`'s full blocks not stored yet; `kv_of(start, end)` gives each layer's K/V of
        prompt positions [start, end) as [kv heads, end - start, head dim] views (copied here).
        Returns how many blocks were added."""
        added, parent, held = 0, None, []
        try:
            for index, tokens in enumerate(self._blocks_of(prompt, len(prompt) // self.block_tokens)):
                block = self._blocks.get(_key(parent, tokens))
                if block is None:
                    block = self._new_block(parent, tokens, index, kv_of)
                    if block is None:
                        break
                    added += 1
                else:
                    self._blocks.move_to_end(block.key)
                block.readers += 1  # the chain being extended must not be evicted for its own children
                held.append(block)
                parent = block
        finally:
            self.release(held)
        return added

    def _new_block(self, parent: Block | None, tokens: tuple[int, ...], index: int,
                   kv_of: Callable[[int, int], list[LayerKV]]) -> Block | None:
        start = index * self.block_tokens
        views = kv_of(start, start + self.block_tokens)
        nbytes = sum(k.nbytes + v.nbytes for k, v in filter(None, views))
        if not self._make_room(nbytes):
            return None
        kv = [None if layer is None else (layer[0].clone(), layer[1].clone()) for layer in views]
        block = Block(next(self._ids), parent, tokens, kv, nbytes)
        self._blocks[block.key] = block
        if parent is not None:
            parent.children += 1
        self.stats.stored_blocks += 1
        self.stats.blocks += 1
        self.stats.bytes += nbytes
        return block

    def _make_room(self, nbytes: int) -> bool:
        """Evict least recently used unreferenced blocks until `nbytes` more fit the budget."""
        while self.stats.bytes + nbytes > self.budget_bytes:
            victim = next((b for b in self._blocks.values() if not b.children and not b.readers), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, block: Block) -> None:
        del self._blocks[block.key]
        if block.parent is not None:
            block.parent.children -= 1
        self.stats.evicted_blocks += 1
        self.stats.blocks -= 1
        self.stats.bytes -= block.nbytes


def resume_from_cache(prefixes: PrefixCache, layout: KVLayout, model, prompt: Sequence[int], device
                      ) -> tuple[KVBatch | None, int]:
    """A one-row KV batch holding the longest cached prefix of `prompt` and its length in tokens,
    or (None, 0) on a miss. The row gets a copy: the cache keeps nothing pinned for it. `layout` must
    declare `supports_prefixes` (the scheduler checks it once, at start)."""
    chain = prefixes.acquire(prompt)
    prefixes.count(len(prompt), len(chain) * prefixes.block_tokens)
    try:
        if not chain:
            return None, 0
        kv = layout.resume(model, prefixes.prefix_kv(chain), device=device)
        return kv, len(chain) * prefixes.block_tokens
    finally:
        prefixes.release(chain)
