"""One batched generation for a fixed set of requests (the dynamic-batch path).

The prompts share one prefill (by default in the default KV layout, kv/select.py); then every step runs one
decode forward for the rows still going. A finished row leaves the batch (and its KV cache) at once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from lmi_serve.engine.batch import Batch, make_row
from lmi_serve.engine.kv.protocol import KVLayout
from lmi_serve.engine.types import GenerationRequest, TokenEvent


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


def generate_static_batch(model, tokenizer, device, requests: Sequence[GenerationRequest],
                          kv_layout: KVLayout | None = None) -> Iterator[tuple[int, TokenEvent]]:
    """Yield (request index, event) for every generated token until all requests finished.

    Order of operations per step: sample every row -> advance rows (stop checks, detokenization,
    events) -> drop finished rows -> one decode forward for the rest.
    """
    rows = [make_row(r, tokenizer, owner=i) for i, r in enumerate(requests)]
    batch = Batch.prefill(model, rows, tokenizer.pad_token_id, device, kv_layout)
    while True:
        for row, event in batch.emit(batch.sample()):
            yield row.owner, event
        batch.evict_finished()
        if not len(batch):
            return
        batch.decode()
