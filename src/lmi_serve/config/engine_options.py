"""Options for the engine and its scheduling: rolling or dynamic batching, the rows and prompt tokens of
a step, the KV cache and its prefix cache, mixed steps, n-gram speculation and the watermark. One concern
of `ModelConfig` (config/models.py assembles them)."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import Field, field_validator

from lmi_serve.config.fields import JOURNAL, RESULTS, Options, choice, parse_bool, text

RollingBatch = Literal["auto", "scheduler", "disable"]
# slots: preallocated buffers written in place (engine/kv/slots.py); dynamic: transformers' DynamicCache,
# concatenated every step (kv/dynamic.py), the baseline and a fallback. Encoder-decoders have their own.
KvCache = Literal["slots", "dynamic"]
# The layout a decoder-only model gets when nothing names one: the server's option and the engine's
# default (engine/kv/select.py) both read this, so tests run what the server runs.
DEFAULT_KV_CACHE: KvCache = "slots"
# Draft tokens per step of n-gram speculation when option.spec_length is 0 (engine/speculation.py reads it too).
DEFAULT_SPEC_LENGTH = 4
_CHOICES = {"rolling_batch": get_args(RollingBatch), "kv_cache": get_args(KvCache)}

# The journal's sections behind the figures of these options
_FEWER_ROWS = (f"{JOURNAL}#the-paces-fit-made-robust-prefix-caching-on-by-default-fewer-rows-than-clients-faster-"
               "start-up-issue-33-2026-11-29-03010505-utc")
_PREFILL_BUDGET = (f"{JOURNAL}#the-one-stream-floor-recounted-lean-decoder-layers-the-prefill-budget-per-device-"
                   "issue-33-2026-11-27-20282127-utc")
_STEP_PACE = (f"{JOURNAL}#a-step-pace-a-prefilling-step-bounded-in-seconds-fitted-to-the-machine-issue-33-"
              "2026-11-29-00140130-utc")
_MIXED_STEPS = (f"{JOURNAL}#one-forward-per-step-joiners-prompts-packed-with-the-running-rows-decode-issue-33-"
                "item-2-2026-11-27-18051835-utc-quiet-box")


class EngineOptions(Options):
    """How the engine batches, schedules and caches."""

    rolling_batch: RollingBatch = Field(
        "auto",
        description=(
            "`auto`: the rolling batch when the built-in text-generation handler serves the model with "
            "`batch_size=1` and no `enable_streaming`, else dynamic batching; `scheduler`: the rolling batch (an "
            "error at start-up where it cannot apply); `disable`: dynamic batching"
        ),
    )
    max_rolling_batch_size: int = Field(
        32, ge=1,
        description=(
            "rows decoded together; with more clients than rows the rest wait for one. A stream's ITL is about "
            "the rows decoding / the tok/s, so fewer rows trade TTFT for ITL (16–32 suits a 2-core CPU; "
            f"[figures]({_FEWER_ROWS}))"
        ),
    )
    max_rolling_batch_prefill_tokens: int | None = Field(
        None, ge=1,
        description=(
            "prompt tokens prefilled per step (unset: 256 on a CPU, 512 on a GPU). A prefill pauses every running "
            "stream, so this bounds the longest gap between tokens; a longer prompt goes in chunks, one a step "
            "(an encoder-decoder's, or one asking for prompt logprobs, goes whole); larger admits bursts faster "
            f"([figures]({_PREFILL_BUDGET}))"
        ),
    )
    max_rolling_batch_step_seconds: float | None = Field(
        None, ge=0,
        description=(
            "the seconds a step that prefills may take (unset: 0.4 on a CPU, off on a GPU; 0: off): the scheduler "
            "fits this machine's step costs from its last steps and admits the prompt tokens that fit (at least "
            "16, at most `max_rolling_batch_prefill_tokens`); the log shows the fit (`Step pace:`) "
            f"([figures]({_STEP_PACE}))"
        ),
    )
    kv_cache: KvCache = Field(
        DEFAULT_KV_CACHE,
        description=(
            "`slots`: each layer's K/V in preallocated buffers, rows of similar length kept together, grown as "
            "used (start-up logs the bound, `max_rolling_batch_size` × `max_model_len` tokens, warns past the "
            "memory available, fails when one row cannot fit); `dynamic`: transformers' `DynamicCache` (the "
            "baseline). Same output either way; encoder-decoder models have their own cache"
        ),
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1,
        description=(
            "on a GPU, the share of the device's memory the model may use (0 < x ≤ 1, as vLLM); less the memory in "
            "use and an activation reserve, it is the K/V budget, logged in tokens. A request waits until its "
            "tokens fit; one that cannot fit alone is refused. Unused on a CPU (see [Memory "
            "budget](gpu.md#memory-budget))"
        ),
    )
    # Prompts that share a prefix reuse its K/V (engine/kv/prefix_cache.py), held within prefix_cache_mb.
    enable_prefix_caching: bool | None = Field(
        None,
        description=(
            "prompts that share a prefix (a system prompt, earlier turns) reuse its K/V, kept in blocks of 16 "
            "tokens: a later prompt prefills only the rest, with the same greedy output. Unset: on wherever it "
            "applies (rolling batch, decoder-only, no tensor parallelism), as in vLLM and TGI; `true` elsewhere is "
            "a start-up error. `GET /models/<m>` shows `engine.prefixCache` "
            f"([figures]({RESULTS}#chat-with-a-shared-system-prompt-prefix-caching))"
        ),
    )
    prefix_cache_mb: int = Field(
        512, ge=1,
        description=(
            "memory for cached prefix blocks (MiB); past it the least recently used block that no later block and"
            " no running prefill refers to is dropped (SmolLM2: 46 KB per token, so 512 MiB holds ~11,000 tokens)"
        ),
    )
    mixed_steps: bool | None = Field(
        None,
        description=(
            "one forward per step: the prompts joining the rolling batch (or a long one's next chunk) are packed "
            "with the running rows' decode, reading the weights once, with the same logits as separate forwards. "
            "Decoder-only full-attention models of the families the architecture matrix checks; `false`: separate "
            "forwards. Unset: true on a CPU, false on a GPU ([figures]"
            f"({_MIXED_STEPS}), [GPU](gpu.md#results))"
        ),
    )
    # N-gram speculation (engine/speculation.py), under LMI's names (draft_model_id, spec_length) and vLLM's
    # for the n-gram sizes looked up
    draft_model_id: Literal["ngram"] | None = Field(
        None,
        description=(
            "`ngram`: speculative decoding by prompt lookup, no draft model: a batch of one row guesses its next "
            "tokens from its own prompt and output and keeps those it would have chosen anyway. Pays on text that "
            "repeats its prompt; rolling batch, decoder-only, no tensor parallelism; a draft model id is refused "
            "(see [n-gram speculation](models.md#faster-single-streams-n-gram-speculation))"
        ),
        json_schema_extra={"doc_default": "off"},
    )
    spec_length: int = Field(
        0, ge=0, le=16,
        description=f"draft tokens per step with `draft_model_id=ngram` (0: {DEFAULT_SPEC_LENGTH})",
    )
    prompt_lookup_max: int = Field(
        4, ge=1, le=16,
        description="`draft_model_id=ngram`: the longest n-gram looked up (vLLM's name)",
    )
    prompt_lookup_min: int = Field(
        2, ge=1, le=16,
        description="`draft_model_id=ngram`: the shortest n-gram looked up (vLLM's name)",
    )
    # TGI's watermark (engine/sampling/watermark.py): the green list's share of the vocabulary, and its bias
    watermark_gamma: float = Field(
        0.5, gt=0, lt=1,
        description=(
            "the watermark's green-list share of the vocabulary (0 < gamma < 1), for requests with `watermark: "
            "true` (TGI's default)"
        ),
    )
    watermark_delta: float = Field(
        2.0, ge=0,
        description="the bias added to green tokens (≥ 0), for requests with `watermark: true` (TGI's default)",
    )
    batch_size: int = Field(
        1, ge=1,
        description="dynamic batch size: requests in one `handle()` call (unset: 32 for the built-in embedding "
                    "handler, whose forwards are also cut at 16,384 padded tokens)",
    )
    max_batch_delay: int = Field(
        100, ge=0,
        description="ms to wait for a batch to fill after its first request (unset: 0 for the built-in "
                    "embedding handler: the requests queued while its last forward ran)",
    )

    @field_validator("rolling_batch", "kv_cache", mode="before")
    @classmethod
    def _engine_choice(cls, value: Any, info: Any) -> Any:
        return choice(value, _CHOICES[info.field_name])

    @field_validator("enable_prefix_caching", mode="before")
    @classmethod
    def _flag_or_unset(cls, value: Any) -> bool | None:
        return None if value is None else parse_bool(value)

    @field_validator("draft_model_id", mode="before")
    @classmethod
    def _draft(cls, value: Any) -> Any:
        """`ngram`, or vLLM's older spelling `[ngram]`; a model id is refused, naming what is served."""
        if value is None:
            return None
        spelled = text(value).strip().lower().strip("[]")
        if spelled != "ngram":
            raise ValueError("is not served: only `ngram` is (speculation by prompt lookup; a draft model is not "
                             "supported)")
        return spelled
