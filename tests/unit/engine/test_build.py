"""engine/build.py: a loaded model and its ModelConfig become the KV layout and the Engine that serve it,
as the built-in handler wired them (tests/unit/serving/test_handler_protocol.py checks the handler's
Engine arguments end to end), and a tensor-parallel follower gets the same layout, prepared."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from lmi_serve.config.models import ModelConfig
from lmi_serve.engine import build
from lmi_serve.engine.build import Serving, build_engine, follower_layout, prepare_serving
from lmi_serve.engine.kv.dynamic import DYNAMIC
from lmi_serve.engine.kv.encdec import ENCODER_DECODER
from lmi_serve.engine.kv.prefix_cache import PrefixCache
from lmi_serve.engine.kv.replicate import Replicator
from lmi_serve.engine.kv.slot_attention import attends_by_parts
from lmi_serve.engine.kv.slots import SLOTS
from lmi_serve.engine.support import UnsupportedModel

from tiny_seq2seq import tiny_seq2seq  # noqa: E402

CPU = torch.device("cpu")


def config(**options) -> ModelConfig:
    return ModelConfig(name="m", model_id="x", **options)


def unprepared(model):
    model = copy.deepcopy(model)
    model.config._attn_implementation = "sdpa"
    return model


class FakeGroup:
    """model/tp.py's TPGroup as build.py uses it."""

    def __init__(self):
        self.failures, self.watchers, self.stops = [], [], []

    def fail(self, reason: str) -> None:
        self.failures.append(reason)

    def on_failure(self, callback) -> None:
        self.watchers.append(callback)

    def stop(self, *callbacks) -> None:
        self.stops.append(callbacks)


def test_prepare_serving_chooses_prepares_and_caps(tiny_model):
    model = unprepared(tiny_model)
    serving = prepare_serving(model, CPU, config(kv_cache="dynamic", max_model_len=4096, enable_prefix_caching=True,
                                                 prefix_cache_mb=3), rolling=True)
    assert serving.kv_layout is DYNAMIC and attends_by_parts(model)  # prepared before any forward (the warm-up)
    assert serving.max_model_len == 512  # capped at the model's window
    assert serving.adapters is None
    assert isinstance(serving.prefix_cache, PrefixCache) and serving.prefix_cache.budget_bytes == 3 * 2**20
    default = prepare_serving(model, CPU, config(), rolling=False)
    assert default == Serving(SLOTS, 512, None, None)  # dynamic batching: no prefix cache, and no error


def test_prefix_caching_unset_is_on_wherever_it_can_work(tiny_model, smollm2_tokenizer, caplog):
    caplog.set_level("INFO", logger="lmi_serve.engine.build")
    rolling = prepare_serving(unprepared(tiny_model), CPU, config(), rolling=True)
    assert isinstance(rolling.prefix_cache, PrefixCache) and rolling.prefix_cache.budget_bytes == 512 * 2**20
    assert "option.enable_prefix_caching unset: on" in caplog.text
    assert prepare_serving(unprepared(tiny_model), CPU, config(enable_prefix_caching=False),
                           rolling=True).prefix_cache is None
    # Where it cannot work, unset means off (set, each of these is a start-up error: the test below)
    assert prepare_serving(unprepared(tiny_model), CPU, config(), rolling=False).prefix_cache is None
    seq2seq = tiny_seq2seq("t5", len(smollm2_tokenizer))
    assert prepare_serving(seq2seq, CPU, config(), rolling=True).prefix_cache is None


def test_prepare_serving_refuses_what_cannot_work(tiny_model, smollm2_tokenizer):
    with pytest.raises(ValueError, match="^option.enable_prefix_caching: .*needs the rolling batch"):
        prepare_serving(tiny_model, CPU, config(enable_prefix_caching=True), rolling=False)
    with pytest.raises(ValueError, match="^option.enable_lora: LoRA adapters need the rolling batch"):
        prepare_serving(tiny_model, CPU, config(enable_lora=True), rolling=False)
    seq2seq = tiny_seq2seq("t5", len(smollm2_tokenizer))
    with pytest.raises(ValueError, match="^option.enable_prefix_caching: this model's KV cache cannot start a row"):
        prepare_serving(seq2seq, CPU, config(enable_prefix_caching=True), rolling=True)
    assert prepare_serving(seq2seq, CPU, config(kv_cache="dynamic"), rolling=True).kv_layout is ENCODER_DECODER
    unsupported = unprepared(tiny_model)
    unsupported.config.layer_types = ["unknown_attention"] * unsupported.config.num_hidden_layers
    with pytest.raises(UnsupportedModel):
        prepare_serving(unsupported, CPU, config(), rolling=True)


def test_with_tensor_parallelism_the_layout_is_replicated(tiny_model, monkeypatch):
    group, registered = FakeGroup(), []
    monkeypatch.setattr(build, "Replicator", functools.partial(Replicator, send=lambda op: None, heartbeat=None))
    monkeypatch.setattr(build.atexit, "register", lambda *args: registered.append(args))
    serving = prepare_serving(tiny_model, CPU, config(), rolling=True, tp_group=group)
    replicator = serving.kv_layout
    assert isinstance(replicator, Replicator) and replicator.inner is SLOTS
    assert serving.prefix_cache is None  # unset: the followers cannot replay a row resumed from cached blocks
    assert registered == [(group.stop, replicator.stop)]  # the worker exits: so do the followers
    replicator._on_error("gone")
    assert group.failures == ["gone"]


def test_build_engine_is_the_handlers_engine(tiny_model, smollm2_tokenizer):
    options = config(kv_cache="dynamic", max_rolling_batch_size=5, job_queue_size=9, predict_timeout=3.5,
                     max_rolling_batch_prefill_tokens=64, max_model_len=300, enable_prefix_caching=True,
                     watermark_gamma=0.25, watermark_delta=1.5)
    serving = prepare_serving(tiny_model, CPU, options, rolling=True)
    group = FakeGroup()
    engine = build_engine(tiny_model, smollm2_tokenizer, CPU, options, serving, tp_group=group)
    scheduler = engine.scheduler
    assert scheduler.kv_layout is DYNAMIC and scheduler.prefixes is serving.prefix_cache
    assert (scheduler.max_batch_size, scheduler.max_queue, scheduler.max_prefill_tokens) == (5, 9, 64)
    assert (engine.max_model_len, engine.predict_timeout, engine.name) == (300, 3.5, "m")
    assert engine.watermark is not None and engine.adapters is None
    assert group.watchers == [engine.fail]  # a dead rank fails the engine
    assert not engine.alive  # the caller starts it


@pytest.mark.parametrize("on", [True, False])
def test_option_mixed_steps_reaches_the_scheduler(tiny_model, smollm2_tokenizer, on):
    options = config(mixed_steps=on)
    engine = build_engine(tiny_model, smollm2_tokenizer, CPU, options, prepare_serving(tiny_model, CPU, options,
                                                                                       rolling=True))
    assert engine.scheduler.mixed is on  # the tiny Llama mixes (kv/mixed.py) unless the option says no


def test_mixed_steps_are_the_option_or_the_devices_default(tiny_model, smollm2_tokenizer, caplog):
    caplog.set_level("INFO")
    unset = build_engine(tiny_model, smollm2_tokenizer, CPU, config(), prepare_serving(tiny_model, CPU, config(),
                                                                                        rolling=True))
    assert unset.scheduler.mixed is True
    assert "option.mixed_steps unset: mixed steps on cpu" in caplog.text
    assert build.mixed_steps(config(), torch.device("cuda", 0)) is False  # measured: docs/gpu.md
    assert build.mixed_steps(config(mixed_steps=True), torch.device("cuda", 0)) is True
    assert build.mixed_steps(config(mixed_steps=False), CPU) is False


def test_the_prefill_budget_is_the_option_or_the_devices_default(tiny_model, smollm2_tokenizer, caplog):
    caplog.set_level("INFO")
    unset = build_engine(tiny_model, smollm2_tokenizer, CPU, config(), prepare_serving(tiny_model, CPU, config(),
                                                                                        rolling=True))
    assert unset.scheduler.max_prefill_tokens == build.CPU_PREFILL_TOKENS == 256
    assert "max_rolling_batch_prefill_tokens unset: 256 prompt tokens a step on cpu" in caplog.text
    assert build.prefill_tokens(config(), torch.device("cuda", 0)) == build.GPU_PREFILL_TOKENS == 512
    assert build.prefill_tokens(config(max_rolling_batch_prefill_tokens=700), torch.device("cuda", 0)) == 700
    assert build.prefill_tokens(config(max_rolling_batch_prefill_tokens=700), CPU) == 700


def test_build_engine_speculates_as_configured(tiny_model, smollm2_tokenizer, caplog):
    assert build_engine(tiny_model, smollm2_tokenizer, CPU, config(), prepare_serving(
        tiny_model, CPU, config(), rolling=True)).scheduler.speculation is None
    options = config(draft_model_id="ngram", prompt_lookup_max=3)
    with caplog.at_level("INFO", logger="lmi_serve.engine.build"):
        engine = build_engine(tiny_model, smollm2_tokenizer, CPU, options,
                              prepare_serving(tiny_model, CPU, options, rolling=True))
    settings = engine.scheduler.speculation.settings
    assert (settings.length, settings.longest, settings.shortest) == (4, 3, 2)  # spec_length 0: the default, 4
    assert "n-gram speculation on: up to 4 draft tokens" in caplog.text
    options = config(draft_model_id="ngram", spec_length=7)
    seq2seq = Serving(ENCODER_DECODER, 512)
    with pytest.raises(ValueError, match="^option.draft_model_id: this model's KV cache .* cannot verify"):
        build_engine(tiny_model, smollm2_tokenizer, CPU, options, seq2seq)
    engine = build_engine(tiny_model, smollm2_tokenizer, CPU, options, prepare_serving(tiny_model, CPU, options,
                                                                                       rolling=True))
    assert engine.scheduler.speculation.settings.length == 7


def test_a_follower_gets_rank_0s_layout_unwrapped_and_prepared(tiny_model, smollm2_tokenizer):
    model = unprepared(tiny_model)
    assert follower_layout(model, config(kv_cache="dynamic")) is DYNAMIC and attends_by_parts(model)
    assert follower_layout(model, config()) is SLOTS
    assert follower_layout(tiny_seq2seq("bart", len(smollm2_tokenizer)), config()) is ENCODER_DECODER


@pytest.mark.parametrize("choice,kernel_calls", [("auto", True), ("sdpa", False)])
def test_option_decode_attention_chooses_the_decode_steps_attention(tiny_model, smollm2_tokenizer, monkeypatch,
                                                                     choice, kernel_calls):
    from lmi_serve.engine.batch import Batch, make_row
    from lmi_serve.kernels.attention import use_decode_kernel
    from lmi_serve.kernels.cpu import decode_kernel
    from lmi_serve.engine.types import GenerationRequest, SamplingParams, StopParams

    if decode_kernel.kernel() is None:
        pytest.skip("numba's OpenMP layer is unavailable here")
    calls = []
    attend = decode_kernel.attend
    monkeypatch.setattr(decode_kernel, "attend", lambda *args: calls.append(1) or attend(*args))
    model = unprepared(tiny_model)
    use_decode_kernel(model, choice == "auto")  # the kernel plan's decode_attention step (kernels/plan.py)
    layout = prepare_serving(model, CPU, config(decode_attention=choice), rolling=True).kv_layout
    follower = unprepared(tiny_model)
    use_decode_kernel(follower, choice == "auto")
    follower_layout(follower, config(decode_attention=choice))
    for prepared in (model, follower):
        calls.clear()
        stop = StopParams(max_new_tokens=4, ignore_eos=True)
        rows = [make_row(GenerationRequest((1, 2, 3 + i), SamplingParams(), stop), smollm2_tokenizer)
                for i in range(4)]
        batch = Batch.prefill(prepared, rows, smollm2_tokenizer.pad_token_id, CPU, layout)
        batch.sample()
        batch.decode()
        assert bool(calls) is kernel_calls


@pytest.mark.parametrize("rows", [1, 4])
def test_a_bf16_models_decode_steps_take_the_kernel_and_agree_with_sdpa(
        tiny_model, smollm2_tokenizer, monkeypatch, rows):
    """option.dtype=bf16: with `auto` a decode step attends in the kernel, one row or more, and its logits are
    SDPA's to bf16's rounding."""
    from lmi_serve.engine.batch import Batch, make_row
    from lmi_serve.kernels.attention import use_decode_kernel
    from lmi_serve.kernels.cpu import decode_kernel
    from lmi_serve.engine.types import GenerationRequest, SamplingParams, StopParams

    if decode_kernel.kernel() is None:
        pytest.skip("numba's OpenMP layer is unavailable here")
    calls = []
    attend = decode_kernel.attend
    monkeypatch.setattr(decode_kernel, "attend", lambda *args: calls.append(1) or attend(*args))
    logits = {}
    for choice in ("auto", "sdpa"):
        model = unprepared(tiny_model).to(torch.bfloat16)
        use_decode_kernel(model, choice == "auto")  # the kernel plan's decode_attention step (kernels/plan.py)
        layout = prepare_serving(model, CPU, config(decode_attention=choice, dtype="bf16"), rolling=True).kv_layout
        stop = StopParams(max_new_tokens=4, ignore_eos=True)
        requests = [GenerationRequest(tuple(range(1, 4 + 3 * i)), SamplingParams(), stop) for i in range(rows)]
        batch = Batch.prefill(model, [make_row(r, smollm2_tokenizer) for r in requests],
                              smollm2_tokenizer.pad_token_id, CPU, layout)
        batch.sample()
        calls.clear()
        batch.decode()
        assert bool(calls) is (choice == "auto")
        logits[choice] = batch.logits.float()
    torch.testing.assert_close(logits["auto"], logits["sdpa"], rtol=0.02, atol=0.02)


def test_lean_decode_steps_write_and_attend_in_one_call_with_the_same_bits(tiny_model, smollm2_tokenizer,
                                                                           monkeypatch):
    """On the slot cache a lean layer's decode step writes its K/V column and attends in one call
    (SlotCache.decode_attend), at every layer, and the logits are those of transformers' update and
    attention interface, bit for bit (rows of different lengths: a masked step)."""
    from lmi_serve.engine.batch import Batch, make_row
    from lmi_serve.kernels.cpu import decode_kernel
    from lmi_serve.engine.kv.slots import SlotCache
    from lmi_serve.engine.types import GenerationRequest, SamplingParams, StopParams
    from lmi_serve.kernels.layers.lean_layers import use_lean_layers

    if decode_kernel.kernel() is None:
        pytest.skip("numba's OpenMP layer is unavailable here")
    model = unprepared(tiny_model)
    assert use_lean_layers(model)
    layout = prepare_serving(model, CPU, config(), rolling=True).kv_layout
    fused, answered = SlotCache.decode_attend, []

    def counted(self, *args):
        out = fused(self, *args)
        answered.append(out is not None)
        return out

    def steps() -> list[torch.Tensor]:
        stop = StopParams(max_new_tokens=8, ignore_eos=True)
        rows = [make_row(GenerationRequest(tuple(range(1, 3 + 4 * i)), SamplingParams(), stop), smollm2_tokenizer)
                for i in range(3)]
        batch = Batch.prefill(model, rows, smollm2_tokenizer.pad_token_id, CPU, layout)
        batch.sample()
        logits = []
        for _ in range(3):
            batch.decode()
            logits.append(batch.logits.clone())
            batch.sample()
        return logits

    monkeypatch.setattr(SlotCache, "decode_attend", counted)
    one_call = steps()
    assert len(answered) == 3 * model.config.num_hidden_layers and all(answered)
    monkeypatch.setattr(SlotCache, "decode_attend", lambda self, *args: None)  # transformers' way
    assert all(torch.equal(a, b) for a, b in zip(one_call, steps(), strict=True))


def test_the_step_pace_is_the_option_or_the_devices_default(tiny_model, smollm2_tokenizer, caplog):
    caplog.set_level("INFO")
    serving = prepare_serving(tiny_model, CPU, config(), rolling=True)
    unset = build_engine(tiny_model, smollm2_tokenizer, CPU, config(), serving)
    assert unset.scheduler.pace.seconds == build.CPU_STEP_SECONDS == 0.4
    assert "max_rolling_batch_step_seconds unset: steps that prefill paced to 0.40 s on cpu" in caplog.text
    off = build_engine(tiny_model, smollm2_tokenizer, CPU, config(max_rolling_batch_step_seconds=0), serving)
    assert off.scheduler.pace is None
    chosen = build_engine(tiny_model, smollm2_tokenizer, CPU, config(max_rolling_batch_step_seconds=0.2), serving)
    assert chosen.scheduler.pace.seconds == 0.2
    assert build.step_seconds(config(), torch.device("cuda", 0)) is None  # 512 prompt tokens take milliseconds
    assert build.step_seconds(config(max_rolling_batch_step_seconds=0.3), torch.device("cuda", 0)) == 0.3
