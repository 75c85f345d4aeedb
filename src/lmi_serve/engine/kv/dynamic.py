"""The left-padded transformers `DynamicCache` (`option.kv_cache=dynamic`; see kv/protocol.py): the
baseline layout, and the bookkeeping kv/slots.py keeps in its own buffers.

Every row's cache is as long as the longest one; shorter rows are padded on the left, and the
attention mask plus per-row position ids keep padding invisible to the model, so a row's logits do
not depend on its neighbours. `keep` drops leading columns that became padding in every row;
`extend` left-pads whichever cache is shorter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from lmi_serve.engine.kv.mixed import mixes, packed_forward, restorer
from lmi_serve.engine.kv.protocol import KVLayout, Prefilled, forward_inputs, layer_bytes
from lmi_serve.engine.kv.slot_attention import use_parts


def _left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[i, width - len(prompt):] = 1
    return input_ids.to(device), mask.to(device)


class DynamicKV:
    """Row i of `cache`, `mask`, `next_pos` and `pending` is the batch's row i."""

    def __init__(self, model: Any, cache: DynamicCache, mask: torch.Tensor, next_pos: torch.Tensor,
                 pending: torch.Tensor, lengths: Sequence[int] | None = None):
        self.model = model
        self.cache = cache
        self.mask = mask  # [rows, cached length]: 1 for real tokens, 0 for left padding
        self.next_pos = next_pos  # [rows]: position id of the pending token (= real tokens cached)
        self.pending = pending  # [rows]: the token the next decode feeds
        # `next_pos` as the host knows it, so that evicting rows reads nothing from the device (a
        # read is a host sync on a GPU): row i's mask is `mask.shape[1] - lengths[i]` zeros, then ones.
        self.lengths = list(lengths) if lengths is not None else next_pos.tolist()

    @classmethod
    def prefill(cls, model: Any, prompts: Sequence[Sequence[int]], *, pad_id: int, device: torch.device,
                prompt_logits: bool = False, model_inputs: Mapping[str, Any] | None = None) -> Prefilled:
        """The `KVFactory`: one left-padded forward over `prompts`. Until the first `feed`, a row's
        pending token is its last prompt token (a placeholder that keeps every tensor [rows] long).
        `model_inputs` (a one-prompt batch's images) go to the forward: the vision encoder runs and its
        features replace the placeholder tokens' embeddings; the K/V cached is the language model's,
        so the row then decodes as any text row."""
        extra = forward_inputs(model, model_inputs, len(prompts), device)
        input_ids, mask = _left_pad(prompts, pad_id, device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        # No config: every layer keeps its whole KV. Given the config, transformers trims a
        # sliding-window layer's KV to the window, which no longer lines up with our per-row mask
        # (rows of different lengths, left padding) and failed the first mixed batch. With whole
        # layers, transformers' sliding-window mask applies the window; within a row, column
        # distance is position distance (padding is only on the left), so the window is exact.
        cache = DynamicCache()
        with torch.inference_mode():
            out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                        use_cache=True, logits_to_keep=0 if prompt_logits else 1, **extra)
        width = input_ids.shape[1]
        per_row = [out.logits[i, width - len(p):] for i, p in enumerate(prompts)] if prompt_logits else None
        kv = cls(model, cache, mask, mask.sum(dim=-1), input_ids[:, -1], [len(p) for p in prompts])
        return Prefilled(kv, out.logits[:, -1, :], per_row)

    def __len__(self) -> int:
        return self.mask.shape[0]

    def feed(self, tokens: torch.Tensor) -> None:
        self.pending = tokens

    def decode(self) -> torch.Tensor:
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        with torch.inference_mode():
            out = self.model(input_ids=self.pending[:, None], attention_mask=self.mask,
                             position_ids=self.next_pos[:, None], past_key_values=self.cache, use_cache=True)
        self.next_pos = self.next_pos + 1
        self.lengths = [n + 1 for n in self.lengths]
        return out.logits[:, -1, :]

    @classmethod
    def empty(cls, model: Any, device: torch.device) -> "DynamicKV":
        """A one-row batch holding no tokens yet: a joiner whose prompt `decode_with` feeds (contract item 11)."""
        zero = torch.zeros(1, dtype=torch.long, device=device)
        return cls(model, cls._empty_cache(), torch.zeros((1, 0), dtype=torch.long, device=device), zero, zero, [0])

    def decode_with(self, chunks: Sequence[tuple["DynamicKV", Sequence[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode()` and, in the same forward, `prefill_more(tokens)` of each one-row batch of `chunks`
        (kv/mixed.py; contract item 11): the rows' logits [rows, vocab] and each chunk's last [chunks, vocab].
        If the forward raises, every batch is left as it was."""
        for kv, _ in chunks:
            if len(kv) != 1:
                raise ValueError(f"a chunk continues one row, not {len(kv)}")
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        width = self.mask.shape[1]
        padded = min(self.lengths) + 1 < width  # the host's lengths: no read from the device
        decode_mask = self.mask.bool()[:, None, None, :] if padded else None
        restores = [restorer(cache) for cache in (self.cache, *(kv.cache for kv, _ in chunks))]
        try:
            rows, last = packed_forward(self.model, self.cache, self.pending, self.next_pos, decode_mask,
                                        [(kv.cache, tokens, kv.lengths[0]) for kv, tokens in chunks])
        except BaseException:  # every batch as it was: the caller may run the parts separately
            for restore in restores:
                restore()
            self.mask = self.mask[:, :-1]
            raise
        self.next_pos = self.next_pos + 1
        self.lengths = [n + 1 for n in self.lengths]
        for kv, tokens in chunks:
            kv._fed(torch.tensor([list(tokens)], dtype=torch.long, device=kv.mask.device))
        return rows, last

    def _fed(self, ids: torch.Tensor) -> None:
        """Account a one-row batch's chunk `ids` ([1, tokens]) after a forward cached them."""
        self.mask = torch.cat([self.mask, torch.ones_like(ids, dtype=self.mask.dtype)], dim=1)
        self.next_pos = self.next_pos + ids.shape[1]
        self.lengths = [n + ids.shape[1] for n in self.lengths]
        self.pending = ids[:, -1]

    def held_bytes(self) -> int:
        """Bytes of K/V storage held (kv/protocol.py contract item 6)."""
        return layer_bytes(self.cache.layers)

    def prefill_more(self, tokens: Sequence[int]) -> torch.Tensor:
        """Continue a one-row prefill with the next chunk of its prompt (chunked prefill, see
        chunked.py): one forward over `tokens` after what is cached; [1, vocab] logits of the last."""
        if len(self) != 1:
            raise ValueError(f"a chunked prefill continues one row, not {len(self)}")
        device = self.mask.device
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)
        positions = self.next_pos[:, None] + torch.arange(len(tokens), device=device)[None, :]
        mask = torch.cat([self.mask, torch.ones_like(ids, dtype=self.mask.dtype)], dim=1)
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                             past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self._fed(ids)
        return out.logits[:, -1, :]

    def verify(self, drafts: Sequence[int]) -> torch.Tensor:
        """Feed a one-row batch its pending token and then `drafts` (speculation, engine/speculation.py),
        caching all of them: [1 + len(drafts), vocab] logits, one per position fed. `discard` then
        drops the drafts the engine did not choose."""
        if len(self) != 1:
            raise ValueError(f"speculation verifies one row, not {len(self)}")
        device = self.mask.device
        ids = torch.cat([self.pending[:, None], torch.tensor([list(drafts)], dtype=torch.long, device=device)], dim=1)
        positions = self.next_pos[:, None] + torch.arange(ids.shape[1], device=device)[None, :]
        self.mask = torch.cat([self.mask, torch.ones_like(ids, dtype=self.mask.dtype)], dim=1)
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=positions,
                             past_key_values=self.cache, use_cache=True)
        self.next_pos = self.next_pos + ids.shape[1]
        self.lengths = [n + ids.shape[1] for n in self.lengths]
        return out.logits[0]

    def discard(self, tokens: int) -> None:
        """Drop the last `tokens` cached tokens of a one-row batch (drafts `verify` fed and the engine
        did not choose); the next `feed` sets the token that follows what is left."""
        if not tokens:
            return
        if len(self) != 1 or tokens >= self.lengths[0]:
            raise ValueError(f"cannot discard {tokens} of {self.lengths} cached tokens")
        self.cache.crop(-tokens)  # a SlotCache's layers crop their parts (kv/slots.py)
        self.mask = self.mask[:, :-tokens]
        self.next_pos = self.next_pos - tokens
        self.lengths = [n - tokens for n in self.lengths]

    @staticmethod
    def _empty_cache() -> DynamicCache:
        return DynamicCache()  # no config: whole layers (see `prefill`)

    @classmethod
    def resume(cls, model: Any, prefix: Sequence[tuple[torch.Tensor, torch.Tensor] | None], *,
               device: torch.device) -> "DynamicKV":
        """A one-row batch whose cache already holds a prompt's first tokens (prefix caching, see
        kv/prefix_cache.py): per layer their K and V, [1, kv heads, tokens, head dim], or None for a
        layer that keeps none. Its prefill goes on with `prefill_more`."""
        cache = cls._empty_cache()
        length = 0
        with torch.inference_mode():
            for index, layer in enumerate(prefix):
                if layer is not None:
                    cache.update(layer[0].to(device), layer[1].to(device), index)
                    length = layer[0].shape[2]
        if not length:
            raise ValueError("a resumed prefix holds no tokens")
        mask = torch.ones((1, length), dtype=torch.long, device=device)
        return cls(model, cache, mask, torch.tensor([length], device=device),
                   torch.zeros(1, dtype=torch.long, device=device), [length])

    def row_kv(self, row: int, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per layer, views of row `row`'s K and V for its token positions [start, end) ([kv heads,
        end - start, head dim]; None for a layer that keeps none). A row's tokens are the last
        `next_pos` columns of the cache (padding is on the left)."""
        first = self.mask.shape[1] - self.lengths[row]
        return [(layer.keys[row, :, first + start:first + end], layer.values[row, :, first + start:first + end])
                if layer.is_initialized and layer.keys.numel() else None for layer in self.cache.layers]

    def keep(self, indices: Sequence[int]) -> None:
        """Keep the rows at `indices`, then drop leading columns that became padding in every row."""
        index = torch.tensor(list(indices), dtype=torch.long, device=self.mask.device)
        self.lengths = [self.lengths[i] for i in indices]
        self.mask = keep_rows(self.cache, self.mask, index,
                              self.mask.shape[1] - max(self.lengths) if self.lengths else 0)
        self.next_pos, self.pending = self.next_pos[index], self.pending[index]

    def extend(self, other: "DynamicKV") -> None:
        """Append `other`'s rows, left-padding whichever cache is shorter."""
        self.mask = join_left_padded(self.cache, self.mask, other.cache, other.mask)
        self.next_pos = torch.cat([self.next_pos, other.next_pos])
        self.pending = torch.cat([self.pending, other.pending])
        self.lengths = self.lengths + other.lengths


class DynamicLayout(KVLayout):
    """DynamicKV's layout: chunked prefill and prefix reuse, and kv/slot_attention.py's attention
    (which, over one tensor, is SDPA's: every decoder-only layout attends through the same function)."""

    name = "dynamic"
    supports_chunks = True
    supports_prefixes = True
    supports_speculation = True

    def __init__(self, kv_class: type[DynamicKV] = DynamicKV):
        self.kv_class = kv_class  # DynamicKV or a subclass (SlotKV; tests' recording ones)

    def mixes(self, model: Any) -> bool:
        return mixes(model)

    def empty(self, model: Any, device: torch.device) -> DynamicKV:
        return self.kv_class.empty(model, device)

    def prefill(self, model: Any, prompts: Sequence[Sequence[int]], *, pad_id: int, device: torch.device,
                prompt_logits: bool = False, model_inputs: Mapping[str, Any] | None = None) -> Prefilled:
        return self.kv_class.prefill(model, prompts, pad_id=pad_id, device=device, prompt_logits=prompt_logits,
                                     model_inputs=model_inputs)

    def resume(self, model: Any, prefix: Sequence[tuple[torch.Tensor, torch.Tensor] | None], *,
               device: torch.device) -> DynamicKV:
        return self.kv_class.resume(model, prefix, device=device)

    def prepare(self, model: Any) -> None:
        use_parts(model)  # the one place the attention function is installed


DYNAMIC = DynamicLayout()


def leading_padding(mask: torch.Tensor) -> int:
    """How many leading columns of a left-padded `mask` are padding in every row."""
    used = mask.any(dim=0).nonzero()
    return int(used[0]) if used.numel() else 0


def keep_rows(cache: DynamicCache, mask: torch.Tensor, index: torch.Tensor, first: int | None = None
              ) -> torch.Tensor:
    """Keep `cache`'s rows at `index` (in place), drop the leading columns that became padding in
    every row (`first` of them, when the caller knows: otherwise the mask is read), and return the
    mask of what is left. Each layer gets the index on its own device (under device_map=auto the
    layers live on several GPUs, and the mask on the first)."""
    on_device: dict[torch.device, torch.Tensor] = {index.device: index}
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        device = keys.device if isinstance(keys, torch.Tensor) else index.device
        if device not in on_device:
            on_device[device] = index.to(device)
        layer.batch_select_indices(on_device[device])
    mask = mask[index]
    first = leading_padding(mask) if first is None else first
    if first:
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
        mask = mask[:, first:]
    return mask


def join_left_padded(cache: DynamicCache, mask: torch.Tensor, other: DynamicCache, other_mask: torch.Tensor
                     ) -> torch.Tensor:
    """Append `other`'s rows to `cache` (in place), left-padding whichever is shorter; return the
    joined mask."""
    width = max(mask.shape[1], other_mask.shape[1])
    for mine, theirs in zip(cache.layers, other.layers):
        mine.keys = torch.cat([F.pad(t, (0, 0, width - t.shape[2], 0)) for t in (mine.keys, theirs.keys)])
        mine.values = torch.cat([F.pad(t, (0, 0, width - t.shape[2], 0)) for t in (mine.values, theirs.values)])
    return torch.cat([F.pad(m, (width - m.shape[1], 0)) for m in (mask, other_mask)])
