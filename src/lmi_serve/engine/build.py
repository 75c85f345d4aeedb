"""Building the engine: a loaded model and its validated `ModelConfig` become what serves it.

The one place that wires the engine's parts together from the configuration: the support check,
LoRA adapters, the context limit, the KV layout (chosen, memory-checked, prepared, replicated over
the tensor-parallel ranks), the prefix cache, the watermark and the `Engine`. The built-in handler
(serving/handlers/huggingface.py) calls `prepare_serving`, warms the model up, then `build_engine`;
a tensor-parallel follower (server/tp_follower.py) calls `follower_layout`. The engine's own modules
take their parts as arguments and choose none of them.
"""

from __future__ import annotations

import atexit
import logging
from dataclasses import dataclass
from typing import Any

import torch

from lmi_serve.config.models import DEFAULT_SPEC_LENGTH
from lmi_serve.config.sources import ModelConfig
from lmi_serve.engine.adapters import Adapters, model_adapters_folder, start_adapters
from lmi_serve.engine.engine import Engine
from lmi_serve.engine.kv.budget import device_budget
from lmi_serve.engine.kv.prefix_cache import BLOCK_TOKENS, PrefixCache
from lmi_serve.engine.kv.protocol import KVLayout
from lmi_serve.engine.kv.replicate import Replicator
from lmi_serve.engine.kv.select import choose_kv, layout_for
from lmi_serve.engine.policy import max_model_len, vocab_size
from lmi_serve.engine.sampling.watermark import Watermark, WatermarkSettings
from lmi_serve.engine.speculation import NgramSettings, NgramSpeculation
from lmi_serve.engine.support import check_supported

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Serving:
    """What a model is served with, decided once at start-up, in either batching mode."""

    kv_layout: KVLayout  # prepared for the model; with tensor parallelism, a Replicator
    max_model_len: int  # the context limit: option.max_model_len, capped at the model's window
    adapters: Adapters | None = None  # option.enable_lora (the model's layers wrapped)
    prefix_cache: PrefixCache | None = None  # option.enable_prefix_caching


def prepare_serving(model: Any, device: Any, config: ModelConfig, *, rolling: bool, tp_group: Any = None) -> Serving:
    """Check `model`, wrap it for LoRA and choose its KV layout, before anything runs it (the warm-up).
    `rolling`: served by the rolling batch (else dynamic batching: `config.batch_size` rows, and no
    LoRA or prefix cache). `tp_group` (model/tp.py `TPGroup`): rank 0 of a tensor-parallel group, whose
    layout replays every KV operation on the other ranks. Raises UnsupportedModel or ValueError,
    naming the option at fault."""
    # Before LoRA wraps the layers and before the warm-up: a model the engine would answer wrongly
    # never runs. (Engine checks again: it is also built without this function.)
    check_supported(model)
    adapters = _adapters(model, device, config, rolling)  # after the linear-layer swaps the caller made
    length = max_model_len(model, config.max_model_len)
    rows = config.max_rolling_batch_size if rolling else config.batch_size
    layout = choose_kv(model, config.kv_cache, rows=rows, columns=length, device=device)
    layout.prepare(model)  # before the warm-up's forward; followers prepare theirs the same way
    if tp_group is not None:
        layout = _replicated(layout, tp_group)
    return Serving(layout, length, adapters, _prefix_cache(config, layout, rolling))


CPU_PREFILL_TOKENS = 256  # a step carrying 512 prompt tokens kept streams waiting ~0.6 s on a 2-core CPU
GPU_PREFILL_TOKENS = 512  # a GPU's forward over 512 tokens takes milliseconds; fewer only splits prompts more


def prefill_tokens(config: ModelConfig, device: Any) -> int:
    """The step's prompt-token budget: option.max_rolling_batch_prefill_tokens, or the device's default where
    it is unset (benchmarks/journal/2026-11.md, "The prefill budget per device": 256 met the CPU's gap target)."""
    if config.max_rolling_batch_prefill_tokens is not None:
        return config.max_rolling_batch_prefill_tokens
    chosen = GPU_PREFILL_TOKENS if torch.device(device).type == "cuda" else CPU_PREFILL_TOKENS
    log.info("option.max_rolling_batch_prefill_tokens unset: %d prompt tokens a step on %s", chosen, device)
    return chosen


CPU_STEP_SECONDS = 0.4  # the longest gap's target is 0.5 s: room for a beam search's step and the delivery


def step_seconds(config: ModelConfig, device: Any) -> float | None:
    """The seconds a step that prefills may take (engine/pace.py): option.max_rolling_batch_step_seconds (0:
    none), or where it is unset the CPU's default, and none on a GPU (512 prompt tokens take milliseconds)."""
    if config.max_rolling_batch_step_seconds is not None:
        return config.max_rolling_batch_step_seconds or None
    if torch.device(device).type == "cuda":
        return None
    log.info("option.max_rolling_batch_step_seconds unset: steps that prefill paced to %.2f s on %s",
             CPU_STEP_SECONDS, device)
    return CPU_STEP_SECONDS


def default_mixed_steps(device: Any) -> bool:
    """option.mixed_steps where it is unset (`mixed_steps`)."""
    return torch.device(device).type != "cuda"


def mixed_steps(config: ModelConfig, device: Any) -> bool:
    """Whether joiners' prompts ride in the decode forward: option.mixed_steps, or the device's default where it
    is unset: on a CPU, where the step reads the weights once for both (1.03-1.12x tok/s at 32 clients), off on a
    GPU, whose launch-bound step gained no throughput and took 2.3-3.9x the TTFT p50 (docs/gpu.md, seventh run)."""
    if config.mixed_steps is not None:
        return config.mixed_steps
    chosen = default_mixed_steps(device)
    log.info("option.mixed_steps unset: %s on %s", "mixed steps" if chosen else "separate prefill forwards", device)
    return chosen


def build_engine(model: Any, tokenizer: Any, device: Any, config: ModelConfig, serving: Serving, *,
                 tp_group: Any = None) -> Engine:
    """The rolling-batch Engine (not started) for `model` as `serving` says, with the config's limits
    and the model's watermark. With `tp_group`, a rank that dies fails the engine. On a GPU, after the
    warm-up: the K/V budget of option.gpu_memory_utilization (kv/budget.py), logged once."""
    prefill = prefill_tokens(config, device)
    budget = device_budget(model, device, serving.kv_layout, utilization=config.gpu_memory_utilization,
                           prefill_tokens=prefill, rows=config.max_rolling_batch_size)
    if budget is not None:
        log.info(budget.describe(serving.max_model_len, config.max_rolling_batch_size))
        if budget.tokens < serving.max_model_len:
            log.warning("The K/V budget (%d tokens) is under option.max_model_len (%d): requests that may reach "
                        "more are refused; raise option.gpu_memory_utilization or lower option.max_model_len",
                        budget.tokens, serving.max_model_len)
    watermark = Watermark(vocab_size(model, tokenizer), device,
                          WatermarkSettings(config.watermark_gamma, config.watermark_delta))
    engine = Engine(model, tokenizer, device, kv_layout=serving.kv_layout, prefix_cache=serving.prefix_cache,
                    max_batch_size=config.max_rolling_batch_size, max_queue=config.job_queue_size,
                    predict_timeout=config.predict_timeout, max_prefill_tokens=prefill,
                    max_model_len=serving.max_model_len, name=config.name, watermark=watermark,
                    adapters=serving.adapters, kv_tokens=budget.tokens if budget is not None else None,
                    speculation=_speculation(config, serving.kv_layout), mixed_steps=mixed_steps(config, device),
                    step_seconds=step_seconds(config, device), generation_deadline=config.generation_deadline)
    if tp_group is not None:
        tp_group.on_failure(engine.fail)  # a dead rank fails the model: /ping unhealthy, requests end
    return engine


def follower_layout(model: Any, config: ModelConfig) -> KVLayout:
    """A tensor-parallel follower's layout: rank 0's, unwrapped (the follower replays its ops), and
    prepared as rank 0's is, so every rank's shard runs the same forward (its kernels planned before:
    kernels/plan.py, as rank 0's)."""
    layout = layout_for(model, config.kv_cache)
    layout.prepare(model)
    return layout


def _adapters(model: Any, device: Any, config: ModelConfig, rolling: bool) -> Adapters | None:
    if not config.enable_lora:
        return None
    if not rolling:
        raise ValueError("option.enable_lora: LoRA adapters need the rolling batch, and this model is "
                         "served with dynamic batching")
    return start_adapters(model, device, max_loras=config.max_loras, max_rank=config.max_lora_rank,
                          dtype=config.lora_dtype, folder=model_adapters_folder(config.model_dir, config.model_id))


def _replicated(layout: KVLayout, tp_group: Any) -> Replicator:
    """`layout` on every rank (engine/kv/replicate.py); a failed op fails the group."""
    replicator = Replicator(layout, on_error=tp_group.fail)
    atexit.register(tp_group.stop, replicator.stop)  # the worker exits: so do the followers
    return replicator


def _speculation(config: ModelConfig, layout: KVLayout) -> NgramSpeculation | None:
    """The n-gram speculation option.draft_model_id=ngram asks for; a start-up error where the layout
    cannot verify drafts (config/models.py refuses the other combinations)."""
    if config.draft_model_id is None:
        return None
    if not layout.supports_speculation:
        raise ValueError(f"option.draft_model_id: this model's KV cache ({layout.name}) cannot verify draft tokens")
    speculation = NgramSpeculation(NgramSettings(config.spec_length or DEFAULT_SPEC_LENGTH,
                                                 config.prompt_lookup_max, config.prompt_lookup_min))
    log.info(speculation.describe())
    return speculation


def _prefix_cache(config: ModelConfig, layout: KVLayout, rolling: bool) -> PrefixCache | None:
    """The prefix cache option.enable_prefix_caching asks for; a start-up error where it cannot work
    (no rolling batch, or a layout that does not declare `supports_prefixes`). Unset: on where it can work."""
    if config.enable_prefix_caching is None:
        if not (rolling and layout.supports_prefixes):
            return None
        log.info("option.enable_prefix_caching unset: on for this rolling batch")
    elif not config.enable_prefix_caching:
        return None
    if not rolling:
        raise ValueError("option.enable_prefix_caching: prefix caching needs the rolling batch, and this model "
                         "is served with dynamic batching")
    if not layout.supports_prefixes:
        raise ValueError("option.enable_prefix_caching: this model's KV cache cannot start a row from a "
                         "cached prefix (encoder-decoder models are not supported)")
    log.info("Prefix caching on: blocks of %d prompt tokens, at most %d MiB", BLOCK_TOKENS, config.prefix_cache_mb)
    return PrefixCache(config.prefix_cache_mb * 2**20)
