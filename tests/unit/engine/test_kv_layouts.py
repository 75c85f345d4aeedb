"""KV layouts declare what they support (engine/kv/protocol.py `KVLayout`): chunked prefill, prefix
reuse, a memory bound and the attention they need; the tensor-parallel Replicator declares what the
layout it wraps does; chunked prefill and prefix reuse ask the declaration; and the engine's default
layout is the server's."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from lmi_serve.config.models import DEFAULT_KV_CACHE, ModelConfig
from lmi_serve.engine.engine import Engine
from lmi_serve.engine.kv.dynamic import DYNAMIC, DynamicLayout
from lmi_serve.engine.kv.encdec import ENCODER_DECODER
from lmi_serve.engine.kv.prefix_cache import PrefixCache, resume_from_cache
from lmi_serve.engine.kv.replicate import Replicator
from lmi_serve.engine.kv.select import KV_LAYOUTS, layout_for
from lmi_serve.engine.kv.slot_attention import attends_by_parts
from lmi_serve.engine.kv.slots import SLOTS, slot_bytes
from lmi_serve.engine.scheduler import Scheduler
from lmi_serve.engine.types import GenerationRequest, SamplingParams, StopParams

from tiny_seq2seq import tiny_seq2seq  # noqa: E402

CPU = torch.device("cpu")


def greedy(prompt, n: int = 3) -> GenerationRequest:
    return GenerationRequest(tuple(prompt), SamplingParams(), StopParams(max_new_tokens=n, ignore_eos=True))


def unprepared(model):
    """A copy of `model` attending with plain SDPA, as loaded (other tests may have prepared `model`)."""
    model = copy.deepcopy(model)
    model.config._attn_implementation = "sdpa"
    return model


class Declared(DynamicLayout):
    """DynamicKV's layout, declaring less than it could, and recording `resume` and `prepare` calls."""

    def __init__(self, chunks: bool = True, prefixes: bool = True):
        super().__init__()
        self.supports_chunks, self.supports_prefixes = chunks, prefixes
        self.calls: list[str] = []

    def resume(self, model, prefix, *, device):
        self.calls.append("resume")
        return super().resume(model, prefix, device=device)

    def prepare(self, model):
        self.calls.append("prepare")
        super().prepare(model)


def test_each_layout_states_what_it_supports(tiny_model):
    assert [(layout.name, layout.supports_chunks, layout.supports_prefixes, layout.supports_speculation)
            for layout in (DYNAMIC, SLOTS, ENCODER_DECODER)] == [("dynamic", True, True, True),
                                                                 ("slots", True, True, True),
                                                                 ("encoder-decoder", False, False, False)]
    assert KV_LAYOUTS == {"dynamic": DYNAMIC, "slots": SLOTS}
    SLOTS.prepare(tiny_model)
    assert DYNAMIC.mixes(tiny_model) and SLOTS.mixes(tiny_model) and not ENCODER_DECODER.mixes(tiny_model)
    assert SLOTS.memory_bytes(tiny_model, 4, 64) == slot_bytes(tiny_model, 4, 64) > 0
    assert DYNAMIC.memory_bytes(tiny_model, 4, 64) is None and ENCODER_DECODER.memory_bytes(tiny_model, 4, 64) is None
    with pytest.raises(NotImplementedError, match="encoder-decoder KV layout cannot start a row from a cached prefix"):
        ENCODER_DECODER.resume(tiny_model, [], device=CPU)


def test_only_prepare_installs_the_slot_attention(tiny_model, smollm2_tokenizer):
    model = unprepared(tiny_model)
    SLOTS.prefill(model, [[5, 6, 7]], pad_id=0, device=CPU)  # a prefill changes nothing about the model
    assert not attends_by_parts(model)
    SLOTS.prepare(model)
    assert attends_by_parts(model)
    SLOTS.prepare(model)  # idempotent
    assert attends_by_parts(model)
    other = unprepared(tiny_model)
    Scheduler(other, smollm2_tokenizer, CPU, max_batch_size=2, max_queue=2, kv_layout=DYNAMIC)
    assert attends_by_parts(other)  # one attention function for every decoder-only layout


def test_the_replicator_declares_what_the_layout_it_wraps_does_except_prefixes(tiny_model):
    for inner in (DYNAMIC, SLOTS, ENCODER_DECODER):
        replicator = Replicator(inner, send=lambda op: None, heartbeat=None)
        assert replicator.name == inner.name and replicator.supports_chunks == inner.supports_chunks
        assert replicator.memory_bytes(tiny_model, 2, 32) == inner.memory_bytes(tiny_model, 2, 32)
        assert not replicator.supports_prefixes  # resume / row_kv are not replicated
        assert not replicator.supports_speculation  # nor verify / discard (the config refuses both together)
        assert not replicator.mixes(tiny_model)  # decode_with is not replicated: a step's forwards stay separate
        assert not hasattr(replicator, "prefill_more")  # declared, not faked
    recorded = Declared(chunks=False)
    replicator = Replicator(recorded, send=lambda op: None, heartbeat=None)
    replicator.prepare(tiny_model)
    assert recorded.calls == ["prepare"] and not replicator.supports_chunks


def test_the_engine_default_is_the_servers(tiny_model, smollm2_tokenizer):
    assert ModelConfig.model_fields["kv_cache"].default == DEFAULT_KV_CACHE == "slots"
    assert layout_for(tiny_model) is KV_LAYOUTS[DEFAULT_KV_CACHE]
    assert Engine(tiny_model, smollm2_tokenizer, CPU).scheduler.kv_layout is KV_LAYOUTS[DEFAULT_KV_CACHE]
    seq2seq = tiny_seq2seq("t5", len(smollm2_tokenizer))
    assert layout_for(seq2seq) is ENCODER_DECODER and layout_for(seq2seq, "dynamic") is ENCODER_DECODER
    assert Engine(seq2seq, smollm2_tokenizer, CPU).scheduler.kv_layout is ENCODER_DECODER


@pytest.mark.parametrize("chunks", [True, False])
def test_chunked_prefill_asks_the_layout(chunks, tiny_model, smollm2_tokenizer):
    engine = Engine(tiny_model, smollm2_tokenizer, CPU, max_prefill_tokens=8, kv_layout=Declared(chunks=chunks))
    scheduler = engine.scheduler
    generation = engine.generate([greedy(range(100, 140))])
    scheduler.step()
    if chunks:  # the 40-token prompt goes 8 tokens (or fewer) a step
        assert scheduler.chunking is not None and scheduler.stats.prefills == 0
    else:  # whole, as the step's only prefill
        assert scheduler.chunking is None and scheduler.stats.prefills == 1
    while not scheduler.idle:
        scheduler.step()
    assert all(r.error is None for r in generation.results())


def test_prefix_reuse_asks_the_layout(tiny_model, smollm2_tokenizer):
    with pytest.raises(ValueError, match="cannot start a row from a cached prefix"):
        Scheduler(tiny_model, smollm2_tokenizer, CPU, max_batch_size=2, max_queue=2,
                  kv_layout=Declared(prefixes=False), prefix_cache=PrefixCache(2**20))
    layout, cache, prompt = Declared(), PrefixCache(2**20, block_tokens=4), list(range(100, 125))
    kv = layout.prefill(tiny_model, [prompt], pad_id=0, device=CPU).kv
    assert cache.store(prompt, functools.partial(kv.row_kv, 0)) == 6
    resumed, hit = resume_from_cache(cache, layout, tiny_model, prompt + [7], CPU)
    assert hit == 24 and len(resumed) == 1 and layout.calls == ["resume"]
