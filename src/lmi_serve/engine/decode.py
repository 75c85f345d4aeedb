"""Steps 5-6 of `Scheduler.step` (scheduler.py): one decode forward for every running row, then each
row's token sampled, stop-checked and emitted. The Scheduler holds a `Decode` beside its `Prefill`
(prefill.py) and delivers the events and evicts the finished rows itself.

With n-gram speculation (speculation.py) a batch of one row feeds its pending token and its drafts in
one forward (the KV layout's `verify`, kv/protocol.py item 10) and takes, position by position, the
token a decode step would choose there while it equals the draft fed after it. A forward that raises
fails the running rows (guarded.py); the scheduler drops the batch and goes on.
"""

from __future__ import annotations

from lmi_serve.engine.batch import Batch, Row
from lmi_serve.engine.guarded import FailureCount, guarded_forward
from lmi_serve.engine.phases import DECODE, EVICT
from lmi_serve.engine.speculation import NgramSpeculation
from lmi_serve.engine.step_ops import StepOps
from lmi_serve.engine.types import TokenEvent


class Decode:
    """The decode half of the step (module docstring)."""

    def __init__(self, ops: StepOps, stats: FailureCount, speculation: NgramSpeculation | None = None):
        self.ops, self.stats, self.speculation = ops, stats, speculation

    def run(self, batch: Batch, forwarded: bool = False) -> list[tuple[Row, TokenEvent]] | None:
        """One decode forward of `batch` (with drafts, `_verify` instead), its tokens sampled and
        emitted; the events, or None when it failed (its rows failed). `forwarded`: a mixed forward
        (scheduler.py `_mixed_step`) already left the logits to sample."""
        drafts = [] if forwarded else self._drafts(batch)
        failure = f"Decode step failed; failing its {len(batch)} running request{'' if drafts else 's'}"
        with guarded_forward(batch.rows, self.stats, failure) as forward:
            if drafts:
                events = self._verify(batch, drafts)
            else:
                if not forwarded:
                    with self.ops.forward(DECODE, batch.adapter_slots):
                        batch.decode()
                events = self.ops.emit(batch, self.ops.sample(batch))
        return None if forward.failed else events

    def _drafts(self, batch: Batch) -> list[int]:
        """The one row's draft tokens (none without speculation, or with more rows), no more than it may
        still generate after them: every token fed stays within its request's length."""
        if self.speculation is None or len(batch) != 1:
            return []
        row = batch.rows[0]
        room = row.request.stop.max_new_tokens - row.generated - 1
        return self.speculation.drafts(row, row.request.prompt_ids, row.token_ids)[:room] if room > 0 else []

    def _verify(self, batch: Batch, drafts: list[int]) -> list[tuple[Row, TokenEvent]]:
        """One forward over the one row's pending token and `drafts`; then, position by position, the
        token a decode step would choose there, while it equals the draft fed after it. The first that
        differs (or all drafts matching, the next position's) is the row's pending token; the drafts
        after it leave the cache. The events of the tokens chosen."""
        row = batch.rows[0]
        events: list[tuple[Row, TokenEvent]] = []
        with self.ops.forward(DECODE, batch.adapter_slots):
            logits = batch.kv.verify(drafts)
        for position, draft in enumerate([*drafts, None]):
            batch.logits = logits[position:position + 1]
            events += self.ops.emit(batch, self.ops.sample(batch))
            if row.finished or row.token_ids[-1] != draft:
                break
        with self.ops.phases.measure(EVICT):
            batch.kv.discard(len(drafts) - position)
        self.speculation.record(len(drafts), position)
        return events
