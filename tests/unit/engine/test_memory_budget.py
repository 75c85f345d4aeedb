"""The K/V memory budget (engine/kv/budget.py, option.gpu_memory_utilization): its arithmetic from a
faked `torch.cuda`, admission waiting for room under a small budget (the real Scheduler on the tiny
model, the capacity given directly), the refusal of a request that could never fit, and a CUDA
out-of-memory in a step failing only that step's rows."""

from __future__ import annotations

import logging

import pytest
import torch
from pydantic import ValidationError

from lmi_serve.config.models import ModelConfig
from lmi_serve.engine.engine import Engine
from lmi_serve.engine.handle import RequestHandle
from lmi_serve.engine.kv import select
from lmi_serve.engine.kv.budget import activation_reserve, device_budget, kv_bytes_per_token, request_tokens
from lmi_serve.engine.kv.dynamic import DYNAMIC
from lmi_serve.engine.kv.slots import SLOTS, slot_bytes
from lmi_serve.engine.scheduler import Scheduler
from lmi_serve.engine.static_batch import generate_static_batch
from lmi_serve.engine.types import FinishReason, GenerationRequest, SamplingParams, StopParams
from lmi_serve.errors import InvalidRequest

from engine_prompts import PROMPTS  # noqa: E402

CPU = torch.device("cpu")
GIB = 2**30


@pytest.fixture(scope="module")
def prompt_ids(smollm2_tokenizer):
    return [tuple(smollm2_tokenizer.encode(p, add_special_tokens=False)) for p in PROMPTS[:6]]


def greedy(prompt, n=6) -> GenerationRequest:
    return GenerationRequest(tuple(prompt), SamplingParams(), StopParams(max_new_tokens=n, ignore_eos=True))


def alone(model, tok, request) -> list[int]:
    return [event.token_id for _, event in generate_static_batch(model, tok, CPU, [request])]


class FakeCuda:
    """`torch.cuda` as a GPU with `total` bytes of which `free` are free reports it."""

    def __init__(self, monkeypatch, *, total: int, free: int):
        self.emptied = 0
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
        monkeypatch.setattr(torch.cuda, "empty_cache", self._empty)

    def _empty(self) -> None:
        self.emptied += 1


# -- the arithmetic --------------------------------------------------------------------------------


def test_budget_is_utilization_of_total_less_in_use_and_the_activation_reserve(monkeypatch, tiny_model):
    cuda = FakeCuda(monkeypatch, total=80 * GIB, free=60 * GIB)
    budget = device_budget(tiny_model, "cuda:0", SLOTS, utilization=0.9, prefill_tokens=512, rows=32)
    per_token = slot_bytes(tiny_model, 1, 1)
    reserve = activation_reserve(tiny_model, prefill_tokens=512, rows=32)
    assert budget.bytes_per_token == per_token and budget.reserve_bytes == reserve > 0
    assert budget.in_use_bytes == 20 * GIB
    assert budget.tokens == (int(0.9 * 80 * GIB) - 20 * GIB - reserve) // per_token
    assert cuda.emptied == 1  # the warm-up's cached blocks go back before measuring
    line = budget.describe(2048, 32)
    assert "0.9 x 80.0 GiB - 20.0 GiB in use" in line and f"{budget.tokens} tokens" in line
    assert f"{budget.tokens // 2048} rows at the full 2048-token context" in line


def test_per_token_bytes_from_the_config_when_the_layout_declares_no_bound(tiny_model):
    assert DYNAMIC.memory_bytes(tiny_model, 1, 1) is None
    expected = slot_bytes(tiny_model, 1, 1)
    assert kv_bytes_per_token(tiny_model, DYNAMIC) == kv_bytes_per_token(tiny_model, SLOTS) == expected


def test_no_budget_on_a_cpu(monkeypatch, tiny_model):
    FakeCuda(monkeypatch, total=80 * GIB, free=60 * GIB)  # even with a GPU present, a CPU model has none
    assert device_budget(tiny_model, CPU, SLOTS, utilization=0.9, prefill_tokens=512, rows=32) is None


def test_no_room_at_all_is_a_start_up_error_naming_the_option(monkeypatch, tiny_model):
    FakeCuda(monkeypatch, total=80 * GIB, free=5 * GIB)  # 75 GiB in use, over 0.9 x 80
    with pytest.raises(ValueError, match="option.gpu_memory_utilization=0.9"):
        device_budget(tiny_model, "cuda:0", SLOTS, utilization=0.9, prefill_tokens=512, rows=32)


def test_on_cuda_the_slot_bound_is_not_compared_with_host_memory(monkeypatch, tiny_model):
    class NoHost:
        @staticmethod
        def virtual_memory():
            raise AssertionError("host memory consulted for a GPU's K/V")

    monkeypatch.setattr(select, "psutil", NoHost)
    assert select.choose_kv(tiny_model, "slots", rows=32, columns=2048, device=torch.device("cuda:0")) is SLOTS
    with pytest.raises(AssertionError):  # on the CPU it still is
        select.choose_kv(tiny_model, "slots", rows=32, columns=2048, device=CPU)


def test_request_tokens_are_prompt_and_new_tokens_capped_at_the_context():
    assert request_tokens(10, 20, 100) == 30
    assert request_tokens(90, 20, 100) == 100
    assert request_tokens(90, 20, None) == 110


# -- the option ------------------------------------------------------------------------------------


def test_option_defaults_to_vllms_and_must_be_a_share():
    assert ModelConfig(name="x", model_id="y").gpu_memory_utilization == 0.9
    assert ModelConfig(name="x", model_id="y", gpu_memory_utilization=1).gpu_memory_utilization == 1
    for bad in (0, -0.5, 1.01):
        with pytest.raises(ValidationError, match="gpu_memory_utilization"):
            ModelConfig(name="x", model_id="y", gpu_memory_utilization=bad)


# -- admission -------------------------------------------------------------------------------------


def run_until_idle(scheduler: Scheduler, capacity: int, steps: int = 500) -> tuple[int, int]:
    """Step until idle; every step, the reservations stay within `capacity`. Returns the steps run
    and the most rows that ran together."""
    most = 0
    for n in range(steps):
        if scheduler.idle:
            return n, most
        scheduler.step()
        assert scheduler.reserved_tokens <= capacity
        most = max(most, scheduler.running)
    pytest.fail("the scheduler did not finish")


def test_requests_wait_for_room_and_join_when_rows_leave(tiny_model, smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    reach = max(len(p) for p in prompt_ids) + 4  # every request may reach this many tokens
    requests = [greedy(p, reach - len(p)) for p in prompt_ids]
    capacity = 2 * reach + reach // 2  # room for two rows at a time, not three
    scheduler = Scheduler(tiny_model, tok, CPU, max_batch_size=8, max_queue=100, kv_tokens=capacity)
    handles = [RequestHandle(r, deadline=None) for r in requests]
    for h in handles:
        scheduler.add(h)
    scheduler.step()
    assert scheduler.running == 2 and len(scheduler.waiting) == 4  # rows are free, K/V room is not
    _, most = run_until_idle(scheduler, capacity)
    assert most == 2
    for request, handle in zip(requests, handles):
        events = list(handle)
        assert events[-1].finish_reason is FinishReason.LENGTH
        assert [e.token_id for e in events] == alone(tiny_model, tok, request)  # greedy output unchanged


def test_without_a_budget_admission_is_unchanged(tiny_model, smollm2_tokenizer, prompt_ids):
    scheduler = Scheduler(tiny_model, smollm2_tokenizer, CPU, max_batch_size=8, max_queue=100)
    for p in prompt_ids:
        scheduler.add(RequestHandle(greedy(p), deadline=None))
    scheduler.step()
    assert scheduler.running == len(prompt_ids) and not scheduler.waiting


def test_a_request_that_could_never_fit_is_refused_naming_the_option(tiny_model, smollm2_tokenizer, prompt_ids):
    engine = Engine(tiny_model, smollm2_tokenizer, CPU, max_batch_size=4, kv_tokens=len(prompt_ids[0]) + 5)
    engine.submit(greedy(prompt_ids[0], 5))  # exactly fits alone
    with pytest.raises(InvalidRequest, match=r"option\.gpu_memory_utilization") as refused:
        engine.submit(greedy(prompt_ids[0], 6))
    assert f"prompt {len(prompt_ids[0])} + max_new_tokens 6" in str(refused.value)
    assert len(engine.scheduler.waiting) == 1


# -- out of memory ---------------------------------------------------------------------------------


class OutOfMemoryAtDecode:
    """The tiny model, whose `fail_at`-th decode forward raises a CUDA out-of-memory."""

    def __init__(self, model, fail_at: int):
        self.model, self.fail_at, self.decodes = model, fail_at, 0
        self.config, self.generation_config = model.config, model.generation_config

    def __call__(self, **kwargs):
        if kwargs["input_ids"].shape[1] == 1:
            self.decodes += 1
            if self.decodes == self.fail_at:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.model(**kwargs)


def test_out_of_memory_in_a_decode_fails_its_rows_empties_the_cache_and_serving_goes_on(
        monkeypatch, caplog, tiny_model, smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    scheduler = Scheduler(OutOfMemoryAtDecode(tiny_model, fail_at=2), tok, CPU, max_batch_size=2, max_queue=100)
    requests = [greedy(prompt_ids[i], 6) for i in (0, 1, 2)]
    handles = [RequestHandle(r, deadline=None) for r in requests]
    for h in handles:
        scheduler.add(h)  # the third waits for a row
    with caplog.at_level(logging.WARNING, logger="lmi_serve.engine.scheduler"):
        run_until_idle(scheduler, capacity=10**9)
    for handle in handles[:2]:
        last = list(handle)[-1]
        assert last.finish_reason is FinishReason.ERROR and "out of memory" in last.error
    assert [e.token_id for e in handles[2]] == alone(tiny_model, tok, requests[2])
    assert emptied and scheduler.stats.failed_steps == 1
    assert "CUDA out of memory in a step" in caplog.text


# -- wiring ----------------------------------------------------------------------------------------


def test_build_engine_sizes_the_budget_after_the_warm_up_logs_it_and_bounds_the_scheduler(
        monkeypatch, caplog, tiny_model, smollm2_tokenizer):
    """build_engine (engine/build.py) asks for the device's budget with the options, logs it once and
    gives its tokens to the scheduler; the device is faked as CUDA for the budget alone."""
    from lmi_serve.engine import build
    from lmi_serve.engine.kv import budget as budget_module

    FakeCuda(monkeypatch, total=8 * GIB, free=7 * GIB)
    asked = {}

    def on_cuda(model, device, layout, **kwargs):
        asked.update(kwargs)
        return budget_module.device_budget(model, "cuda:0", layout, **kwargs)

    monkeypatch.setattr(build, "device_budget", on_cuda)
    options = ModelConfig(name="m", model_id="x", gpu_memory_utilization=0.5, max_rolling_batch_size=8,
                          max_rolling_batch_prefill_tokens=256)
    serving = build.prepare_serving(tiny_model, CPU, options, rolling=True)
    with caplog.at_level(logging.INFO, logger="lmi_serve.engine.build"):
        engine = build.build_engine(tiny_model, smollm2_tokenizer, CPU, options, serving)
    assert asked == {"utilization": 0.5, "prefill_tokens": 256, "rows": 8}
    expected = device_budget(tiny_model, "cuda:0", serving.kv_layout, **asked)
    assert engine.scheduler.kv_tokens == expected.tokens > 0
    assert engine.scheduler.max_model_len == serving.max_model_len
    assert caplog.text.count("Memory budget: 0.5 x 8.0 GiB - 1.0 GiB in use") == 1


def test_on_a_cpu_build_engine_sets_no_budget(tiny_model, smollm2_tokenizer):
    from lmi_serve.engine import build

    options = ModelConfig(name="m", model_id="x")
    serving = build.prepare_serving(tiny_model, CPU, options, rolling=True)
    assert build.build_engine(tiny_model, smollm2_tokenizer, CPU, options, serving).scheduler.kv_tokens is None
