"""Per-phase timers of the rolling batch (engine/phases.py): each second goes to the innermost phase
open, and an Engine's counts say exactly how often each phase of its steps ran."""

from __future__ import annotations

import pytest
import torch

from lmi_serve.engine.engine import Engine
from lmi_serve.engine.phases import ADMIT, DECODE, DELIVER, EMIT, EVICT, PHASES, PREFILL, SAMPLE, PhaseClock, for_device
from lmi_serve.engine.types import GenerationRequest, SamplingParams, StopParams

from engine_prompts import PROMPTS as ALL_PROMPTS  # noqa: E402
from waiting import within  # noqa: E402

PROMPTS = ALL_PROMPTS[:3]
LENGTHS = (3, 5, 8)  # max_new_tokens of each prompt's request


def ticking(*times: float):
    """A clock that answers `times` in order."""
    answers = iter(times)
    return lambda: next(answers)


def test_nested_phase_time_counts_once_for_the_innermost():
    clock = PhaseClock(now=ticking(0.0, 2.0, 5.0, 6.0))
    with clock.measure(ADMIT):  # 0
        with clock.measure(EVICT):  # 2
            pass  # 5
    # 6
    times = clock.snapshot()
    assert times.seconds[ADMIT] == 3.0 and times.seconds[EVICT] == 3.0
    assert times.counts[ADMIT] == 1 and times.counts[EVICT] == 1
    assert all(times.seconds[p] == 0.0 and times.counts[p] == 0 for p in PHASES if p not in (ADMIT, EVICT))


def test_a_phase_that_raises_still_counts_and_closes():
    clock = PhaseClock(now=ticking(0.0, 4.0, 10.0, 11.0))
    with pytest.raises(RuntimeError):
        with clock.measure(DECODE):
            raise RuntimeError("forward failed")
    with clock.measure(SAMPLE):
        pass
    times = clock.snapshot()
    assert times.seconds[DECODE] == 4.0 and times.seconds[SAMPLE] == 1.0


def test_a_snapshot_does_not_move_with_the_clock():
    clock = PhaseClock(now=ticking(0.0, 1.0, 1.0, 3.0))
    with clock.measure(EMIT):
        pass
    before = clock.snapshot()
    with clock.measure(EMIT):
        pass
    assert before.seconds[EMIT] == 1.0 and before.counts[EMIT] == 1
    assert clock.snapshot().seconds[EMIT] == 3.0 and clock.snapshot().counts[EMIT] == 2


@pytest.fixture
def engine(tiny_model, smollm2_tokenizer):
    """An engine not started yet: requests queued before `start` are all admitted by the first step."""
    engine = Engine(tiny_model, smollm2_tokenizer, torch.device("cpu"), max_batch_size=4, max_queue=100)
    yield engine
    engine.stop()


def run(engine: Engine, prompt_ids) -> None:
    requests = [GenerationRequest(ids, SamplingParams(), StopParams(max_new_tokens=n, ignore_eos=True))
                for ids, n in zip(prompt_ids, LENGTHS)]
    results = within(engine.generate(requests).results)
    assert [len(r.events) for r in results] == list(LENGTHS)


def test_every_phase_of_the_steps_is_timed_and_counted(engine, prompt_ids):
    before = engine.stats().phases
    run(engine.start(), prompt_ids)
    engine.stop()  # no step runs past here, so the counters agree with each other
    stats = engine.stats()
    times = stats.phases
    for phase in PHASES:
        assert times.counts[phase] > before.counts[phase], phase
        assert times.seconds[phase] > before.seconds[phase], phase
    assert times.counts[ADMIT] == stats.steps
    assert times.counts[PREFILL] == stats.prefills
    # every row joined at the first step, so the batch decoded until its longest row was done:
    # the first token comes from the prefill, each later one from a decode
    assert times.counts[DECODE] == max(LENGTHS) - 1
    assert stats.steps == max(LENGTHS) - 1  # idle wake-ups after the last row (the loop's) are no steps
    assert times.counts[SAMPLE] == times.counts[EMIT] == times.counts[DELIVER] == stats.prefills + max(LENGTHS) - 1


def test_a_cuda_clock_synchronizes_at_each_phase_boundary_and_a_cpu_clock_never(monkeypatch):
    """On a GPU the host only queues kernels: a phase's time is its GPU time only if the device is
    synchronized when the phase starts and ends (phases.py). Faked here: no CUDA on this machine."""
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    cpu = for_device(torch.device("cpu"))
    with cpu.measure(DECODE), cpu.measure(SAMPLE):
        pass
    assert synced == []
    cuda = for_device(torch.device("cuda", 1))
    with cuda.measure(DECODE):
        with cuda.measure(SAMPLE):
            pass
    assert synced == [torch.device("cuda", 1)] * 4  # entering and leaving each phase
    assert cuda.snapshot().counts[DECODE] == 1 and cuda.snapshot().counts[SAMPLE] == 1
