"""Admission: the per-step prefill budget and the grouping of joiners by prompt length."""

from __future__ import annotations

from lmi_serve.engine.handle import RequestHandle
from lmi_serve.engine.kv.encdec import ENCODER_DECODER
from lmi_serve.engine.scheduler import Scheduler
from lmi_serve.engine.types import GenerationRequest


def handle(length: int) -> RequestHandle:
    return RequestHandle(GenerationRequest(tuple(range(1, length + 1))), deadline=None)


def scheduler(**kwargs) -> Scheduler:
    return Scheduler(None, None, None, max_batch_size=kwargs.pop("max_batch_size", 32), max_queue=100, **kwargs)


def lengths(groups):
    return [[len(h.request.prompt_ids) for h in g] for g in groups]


def test_joiners_of_similar_length_share_a_prefill_and_long_ones_go_apart():
    groups = scheduler().prefill.groups([handle(n) for n in (100, 10, 12, 105, 11, 400)])
    assert lengths(groups) == [[10, 11, 12], [100, 105], [400]]


def test_padding_limit_is_respected():
    s = scheduler(max_padding=0.25)
    for group in s.prefill.groups([handle(n) for n in (8, 9, 10, 13, 16, 20, 25, 31, 40)]):
        sizes = [len(h.request.prompt_ids) for h in group]
        assert len(sizes) * max(sizes) <= 1.25 * sum(sizes)


def test_admission_stops_at_the_prefill_budget_but_always_admits_one():
    """With a KV implementation that cannot chunk a prompt (encoder-decoder rows), a prompt over the
    budget goes whole as the step's only prefill; test_chunked_prefill.py covers the chunking ones."""
    s = scheduler(max_prefill_tokens=100, kv_layout=ENCODER_DECODER)
    for n in (60, 30, 20, 5):
        s.waiting.append(handle(n))
    assert [len(h.request.prompt_ids) for h in s._admit()] == [60, 30]
    assert [len(h.request.prompt_ids) for h in s._admit()] == [20, 5]
    s.waiting.append(handle(500))
    assert [len(h.request.prompt_ids) for h in s._admit()] == [500]


def test_admission_never_exceeds_free_rows():
    s = scheduler(max_batch_size=2)
    for n in (1, 1, 1):
        s.waiting.append(handle(n))
    assert len(s._admit()) == 2 and len(s.waiting) == 1
