"""engine/step_ops.py: a step's forward scope (its phase timed, its rows' LoRA slots routed in one
place) and the timed sample / emit / deliver / merge the scheduler and its prefill share."""

from __future__ import annotations

from types import SimpleNamespace

from lmi_serve.engine.phases import DECODE, DELIVER, PREFILL, PhaseClock
from lmi_serve.engine.step_ops import StepOps
from lmi_serve.model.lora import LoraRouter


class Ticks:
    """A clock that advances one second per reading."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 1.0
        return self.now


def test_a_forward_routes_its_rows_slots_only_while_it_runs_and_counts_its_phase():
    router = LoraRouter()
    model = SimpleNamespace(lmi_lora=router)  # what LoraModel.wrap leaves on the model (model/lora.py)
    phases = PhaseClock(now=Ticks())
    ops = StepOps(model, phases)
    with ops.forward(PREFILL, [None, 3, 3]):
        assert router.groups == [(3, [1, 2])] and router.batch == 3 and not router.packed
    assert router.groups == [] and router.batch == 0
    with ops.forward(DECODE, [3, 3, 3, 3], packed=True):
        assert router.groups == [(3, None)] and router.packed  # every token on slot 3
    assert router.groups == []
    counts = phases.snapshot().counts
    assert counts[PREFILL] == 1 and counts[DECODE] == 1


def test_rows_without_adapters_or_a_model_without_lora_route_nothing():
    router = LoraRouter()
    ops = StepOps(SimpleNamespace(lmi_lora=router), PhaseClock())
    with ops.forward(DECODE, [None, None]):
        assert router.batch == 0  # the base model, untouched
    with StepOps(SimpleNamespace(), PhaseClock()).forward(DECODE, [1, 2]):
        pass  # no LoRA layers: nothing to route


def test_deliver_pushes_each_event_to_its_rows_owner_and_merge_joins_in_order():
    pushed = []
    owner = SimpleNamespace(push=pushed.append)
    phases = PhaseClock(now=Ticks())
    ops = StepOps(None, phases)
    ops.deliver([(SimpleNamespace(owner=owner), "a"), (SimpleNamespace(owner=owner), "b")])
    assert pushed == ["a", "b"] and phases.snapshot().counts[DELIVER] == 1

    class Part:
        def __init__(self, rows):
            self.rows = rows

        def concatenate(self, other):
            self.rows += other.rows

    assert ops.merge([]) is None
    assert ops.merge([Part([1]), Part([2, 3]), Part([4])]).rows == [1, 2, 3, 4]
