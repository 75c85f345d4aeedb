"""Host syncs per step of the rolling batch (issue 30, item 2).

On a GPU the scheduler thread queues kernels and only waits when Python reads a tensor's values:
`.item()`, `.tolist()`, `.cpu()` / `.numpy()`, `bool(tensor)`, `int(tensor)` / `float(tensor)` /
`operator.index(tensor)`, `nonzero`, and indexing by a boolean mask (which runs `nonzero`). This
test counts those calls while the real scheduler steps a batch on the CPU (where they cost nothing,
but the count is the GPU's) with rows joining and leaving, greedy and sampled rows with penalties,
a grammar row, a row with `min_new_tokens` (soft bans) and a LoRA row. A decode step may read the
sampled ids once (`.tolist()` of the one tensor the events are built from); everything else it
needs is known to the host already.

What it does not count: host-to-device copies of tensors built from Python lists (`torch.tensor(...,
device=...)`), which stall the host on a GPU only until the copy is queued from pageable memory, and
syncs inside torch itself or inside the model's forward (transformers' mask building); a GPU run
(`tests/gpu/`) is what confirms the wall-clock result.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import json
import os
import sys

import pytest
import torch

from lmi_serve.engine.adapters import start_adapters
from lmi_serve.engine.engine import Engine
from lmi_serve.engine.scheduler import Scheduler
from lmi_serve.engine.types import FinishReason, GenerationRequest, GuidedDecoding, SamplingParams, StopParams

from engine_prompts import PROMPTS  # noqa: E402
from lora_adapters import build_adapter  # noqa: E402

CPU = torch.device("cpu")
SCHEMA = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["unit", "days"], "additionalProperties": False}
# Tensor methods whose result needs the tensor's values on the host.
READS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__")


def _in_transformers() -> bool:
    """Whether the caller runs inside transformers (the model's forward), not the engine."""
    frame = sys._getframe(2)
    while frame is not None:
        if f"{os.sep}transformers{os.sep}" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class SyncCounter:
    """Counts, while `active`, the calls that would wait for the device (module docstring), by name."""

    def __init__(self):
        self.active = False
        self.calls: collections.Counter[str] = collections.Counter()

    def _count(self, name: str) -> None:
        # kernels/cpu/decode_kernel.py runs on CPU tensors only: its `.numpy()` views host memory, never waits for a device
        if self.active and not sys._getframe(2).f_code.co_filename.endswith(f"kv{os.sep}decode_kernel.py"):
            self.calls[f"{name} (in transformers)" if _in_transformers() else name] += 1

    @contextlib.contextmanager
    def installed(self):
        saved = {name: getattr(torch.Tensor, name) for name in (*READS, "__getitem__")}
        saved_nonzero = torch.nonzero

        def wrap(name, method):
            def counted(self_, *args, **kwargs):
                self._count(name)
                return method(self_, *args, **kwargs)
            return counted

        def getitem(self_, index):
            if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
                self._count("bool-mask index")
            return saved["__getitem__"](self_, index)

        def nonzero(*args, **kwargs):
            self._count("torch.nonzero")
            return saved_nonzero(*args, **kwargs)

        try:
            for name in READS:
                setattr(torch.Tensor, name, wrap(name, saved[name]))
            torch.Tensor.__getitem__ = getitem
            torch.nonzero = nonzero
            yield self
        finally:
            for name, method in saved.items():
                setattr(torch.Tensor, name, method)
            torch.nonzero = saved_nonzero

    @contextlib.contextmanager
    def counting(self):
        self.calls.clear()
        self.active = True
        try:
            yield self.calls
        finally:
            self.active = False


@pytest.fixture(scope="module")
def lora_engine(tiny_model, smollm2_tokenizer, tmp_path_factory):
    model = copy.deepcopy(tiny_model)
    adapters = start_adapters(model, CPU, max_loras=2, max_rank=64, dtype="auto", folder=None)
    adapters.register("alpha", str(build_adapter(tiny_model, tmp_path_factory.mktemp("adapters"), "alpha", std=0.3)))
    return Engine(model, smollm2_tokenizer, CPU, max_batch_size=8, max_queue=100, adapters=adapters)


def mix(tokenizer) -> list[GenerationRequest]:
    """Greedy rows of different lengths and budgets, a sampled row with every penalty, a grammar row,
    a row with soft bans (min_new_tokens) and a LoRA row."""
    ids = [tuple(tokenizer.encode(p, add_special_tokens=False)) for p in PROMPTS]
    greedy = [GenerationRequest(ids[i], SamplingParams(), StopParams(max_new_tokens=n, ignore_eos=True))
              for i, n in enumerate((5, 9, 3, 12))]
    penalties = GenerationRequest(ids[4], SamplingParams(do_sample=True, seed=3, temperature=0.8, min_p=0.05,
                                                         repetition_penalty=1.3, presence_penalty=0.5,
                                                         frequency_penalty=0.4),
                                  StopParams(max_new_tokens=10, ignore_eos=True), top_n_tokens=2)
    grammar = GenerationRequest(ids[5], SamplingParams(), StopParams(max_new_tokens=14, eos_token_ids=frozenset({2})),
                                guided=GuidedDecoding(json_schema=json.dumps(SCHEMA)))
    soft = GenerationRequest(ids[6], SamplingParams(), StopParams(max_new_tokens=8, min_new_tokens=4,
                                                                  eos_token_ids=frozenset({2})))
    lora = GenerationRequest(ids[7], SamplingParams(), StopParams(max_new_tokens=11, ignore_eos=True),
                             adapter="alpha")
    return [*greedy, penalties, grammar, soft, lora]


def run_counted(engine: Engine, requests: list[GenerationRequest], counter: SyncCounter):
    """Submit `requests` a few at a time between steps; per step: (prefill forwards, rows running
    before it, rows running after it, the decode's reads by call or None when it decoded nothing)."""
    scheduler = engine.scheduler
    decode_calls: list[collections.Counter] = []
    real_decode = Scheduler._decode

    def decode(self):
        with counter.counting() as calls:
            real_decode(self)
        decode_calls.append(collections.Counter(calls))

    steps, handles, pending = [], [], list(requests)
    with counter.installed(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(Scheduler, "_decode", decode)
        for step in range(60):
            if pending and step % 2 == 0:
                handles += [engine.submit(r) for r in pending[:3]]
                pending = pending[3:]
            if not pending and scheduler.idle:
                break
            prefills, before, decodes = scheduler.stats.prefills, scheduler.running, len(decode_calls)
            scheduler.step()
            decoded = decode_calls[-1] if len(decode_calls) > decodes else None
            steps.append((scheduler.stats.prefills - prefills, before, scheduler.running, decoded))
    return steps, handles


def test_a_decode_step_reads_the_device_once(lora_engine, smollm2_tokenizer):
    counter = SyncCounter()
    steps, handles = run_counted(lora_engine, mix(smollm2_tokenizer), counter)
    for handle in handles:
        result = handle.result()
        assert result.finish_reason in (FinishReason.LENGTH, FinishReason.EOS_TOKEN), result.error
    decodes = [calls for *_, calls in steps if calls is not None]
    assert len(decodes) >= 10 and any(prefills for prefills, *_ in steps)  # rows joined a running batch
    assert any(after < before for prefills, before, after, _ in steps if not prefills)  # and left it
    total = collections.Counter()
    for calls in decodes:
        total.update(calls)
    engine = [sum(n for name, n in calls.items() if "transformers" not in name) for calls in decodes]
    model = [sum(n for name, n in calls.items() if "transformers" in name) for calls in decodes]
    print(f"\nreads per decode step by the engine: {engine}, inside the model's forward: {model}; "
          f"by call over {len(decodes)} decode steps: {dict(total)}")
    assert max(engine) <= 1, f"reads per decode step {engine}: {dict(total)}"
    # transformers' SDPA mask checks whether the attention mask has any padding (`padding_mask.all()`,
    # masking_utils._ignore_causal_mask_sdpa): one read per decode forward that the engine does not make.
    assert max(model) <= 1, f"reads inside the model per decode step {model}: {dict(total)}"
