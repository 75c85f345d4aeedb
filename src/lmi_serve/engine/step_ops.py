"""The operations a scheduler step is made of, each timed as its phase (phases.py): what the
scheduler (scheduler.py) and the prefill it holds (prefill.py) share.

    ops = StepOps(model, phases)
    with ops.forward(DECODE, batch.adapter_slots):
        batch.decode()
    ops.deliver(ops.emit(batch, ops.sample(batch)))

`forward` is the one place where a step's forwards get their LoRA rows (adapters.py `lora_rows`,
model/lora.py): each names only its rows' slots, since each forward of a step has rows of its own (a
prefill group, the chunked prompt, the decode batch, or one packed sequence of all of them). A model
without LoRA layers, or a forward none of whose rows has an adapter, routes nothing and runs the base
model bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from lmi_serve.engine.adapters import lora_rows
from lmi_serve.engine.batch import Batch, Row
from lmi_serve.engine.phases import DELIVER, EMIT, EVICT, SAMPLE, PhaseClock
from lmi_serve.engine.types import TokenEvent

if TYPE_CHECKING:
    from lmi_serve.engine.sampling.sampler import SampleOutput


class StepOps:
    """A step's forward scope, sampling, emitting, delivering and merging, each timed (module docstring)."""

    def __init__(self, model, phases: PhaseClock):
        self.model, self.phases = model, phases

    @contextmanager
    def forward(self, phase: str, slots: Sequence[int | None], packed: bool = False) -> Iterator[None]:
        """The block (one forward) timed as `phase`, its row i (with `packed`, token i: kv/mixed.py) on
        adapter slot `slots[i]` (None: the base model)."""
        with self.phases.measure(phase), lora_rows(self.model, slots, packed=packed):
            yield

    def sample(self, batch: Batch) -> SampleOutput:
        with self.phases.measure(SAMPLE):
            return batch.sample()

    def emit(self, batch: Batch, choice: SampleOutput) -> list[tuple[Row, TokenEvent]]:
        with self.phases.measure(EMIT):
            return batch.emit(choice)

    def deliver(self, events: Iterable[tuple[Row, TokenEvent]]) -> None:
        with self.phases.measure(DELIVER):
            for row, event in events:
                row.owner.push(event)

    def merge(self, batches: list[Batch]) -> Batch | None:
        """`batches` as one (their rows in order); None for none."""
        if not batches:
            return None
        first, *rest = batches
        with self.phases.measure(EVICT):
            for other in rest:
                first.concatenate(other)
        return first
