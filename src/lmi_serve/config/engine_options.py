"""Options for the engine and its scheduling: rolling or dynamic batching, the rows and prompt tokens of
a step, the KV cache and its prefix cache, mixed steps, n-gram speculation and the watermark. One concern
of `ModelConfig` (config/models.py assembles them)."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import Field, field_validator

from lmi_serve.config.fields import Options, choice, parse_bool, text

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
            "rows decoded together (16–32 suits a 2-core CPU). With more clients than rows the rest wait for one: "
            "a stream's ITL is about the rows decoding / the tok/s, so fewer rows trade TTFT for ITL (guidellm's "
            "chat load at 32 clients on a 2-core EPYC, 24 rows against 32: ITL p50 0.76-0.80x, TTFT p50 3.2-5x, "
            "tok/s 0.92-1.03x)"
        ),
    )
    max_rolling_batch_prefill_tokens: int | None = Field(
        None, ge=1,
        description=(
            "prompt tokens prefilled per step (unset: 256 on a CPU, where a step carrying 512 took ~0.6 s on a "
            "2-core EPYC, and 512 on a GPU): a prefill pauses every running stream, so this bounds the longest "
            "gap between tokens; a longer prompt is prefilled in chunks of at most this many tokens (fewer as its"
            " context grows: a chunk's tokens count their attention over the context), one chunk per step, while "
            "the other streams go on (an encoder-decoder's prompt, or one asking for prompt logprobs, goes "
            "whole); larger admits bursts faster"
        ),
    )
    max_rolling_batch_step_seconds: float | None = Field(
        None, ge=0,
        description=(
            "the seconds a step that prefills may take (unset: 0.4 on a CPU, off on a GPU; 0: off): the "
            "scheduler fits what its steps cost on this machine (the running rows' decode, a prompt token, its "
            "attention) from its last steps and admits no more prompt tokens a step than fit in what the decode "
            "leaves (never more than `max_rolling_batch_prefill_tokens`, never fewer than 16), so the longest gap "
            "between tokens holds on a slower CPU too (256 prompt tokens took ~0.2 s on one 2-core EPYC, ~0.4 s on "
            "another); the fitted context at which a prompt token's attention costs what its linear layers do "
            "sizes the chunks of a long prompt. The log shows the fit once made (`Step pace:`)"
        ),
    )
    kv_cache: KvCache = Field(
        DEFAULT_KV_CACHE,
        description=(
            "`slots`: each layer's K/V in preallocated buffers a step writes one column into, kept in parts of "
            "rows of similar length, each attending over its own columns only (a long prompt joining short ones "
            "neither copies nor slows them; grown as used, freed when the part empties; start-up logs the bound, "
            "`max_rolling_batch_size` × `max_model_len` tokens, warns when it exceeds the memory available and "
            "fails when not even one row of `max_model_len` fits); `dynamic`: transformers' `DynamicCache`, "
            "concatenated every step (the baseline). Same output either way; encoder-decoder models have their "
            "own cache"
        ),
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1,
        description=(
            "on a GPU, the share of the device's memory the model may use (vLLM's default, 0 < x ≤ 1): after "
            "loading and warming up, this share of the total, less the memory in use and an activation reserve "
            "for one prefill of `max_rolling_batch_prefill_tokens`, is the K/V budget, logged in tokens; a request"
            " joins the rolling batch only when the tokens it may reach (prompt + max_new_tokens, capped at the "
            "context) fit beside those the running rows may reach, else it waits; one that could not fit even "
            "alone is refused. Unused on a CPU (the `slots` bound is checked against host memory)"
        ),
    )
    # Prompts that share a prefix reuse its K/V (engine/kv/prefix_cache.py), held within prefix_cache_mb.
    enable_prefix_caching: bool | None = Field(
        None,
        description=(
            "prompts that share a prefix (a chat's system prompt, few-shot examples, earlier turns) reuse its "
            "K/V: after a prefill the prompt's full blocks of 16 tokens are kept, and a later prompt starting "
            "with the same blocks prefills only the rest (at least its last token); blocks are keyed by "
            "everything before them, so only a whole shared prefix matches. Same greedy output as without it; "
            "prompts with images and LoRA rows prefill in full. `GET /models/<m>` shows `engine.prefixCache` "
            "(lookups, hits, tokens reused, blocks, bytes). Unset: on wherever the model can take it (a rolling "
            "batch of a decoder-only model, no tensor parallelism), as vLLM and TGI do. Measured (benchmarks/RESULTS.md): "
            "with a 215-token system prompt shared by 16 chat clients, 1.40-1.54x tok/s and 1.7-2.9x lower TTFT "
            "p50; on guidellm's chat load, whose prompts share one 16-token block of ~130, level (0.99-1.02x "
            "tok/s). `true` where it cannot apply is a start-up error (dynamic "
            "batching, encoder-decoder models, tensor parallelism); `false` turns it off"
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
            "one forward per step: the prompts of requests joining the rolling batch (and the next chunk of a "
            "long one) go through the model with the running rows' decode, packed into one sequence "
            "(engine/kv/mixed.py), so the weights are read once for both and running streams are not stalled "
            "by a prefill forward of its own. The same logits as separate forwards (held by the architecture "
            "matrix); a joiner's first step gives it one token instead of two. Applies to decoder-only models of "
            "full-attention layers of the families the matrix checks (Llama, Qwen2, Qwen3, Phi, GPT-NeoX); "
            "others and prompts with images or prompt logprobs keep separate forwards (LoRA rows are packed "
            "too, each token with its adapter). `false`: separate forwards always. Unset: true on a CPU, false "
            "on a GPU, where mixed steps gained no throughput on an H100/H200 and took 2.3-3.9x the TTFT p50 at "
            "32-128 clients (docs/gpu.md)"
        ),
    )
    # N-gram speculation (engine/speculation.py), under LMI's names (draft_model_id, spec_length) and vLLM's
    # for the n-gram sizes looked up
    draft_model_id: Literal["ngram"] | None = Field(
        None,
        description=(
            "`ngram`: speculative decoding by prompt lookup, no draft model. A batch of one row guesses its next "
            "tokens from its own prompt and output (the tokens that followed the latest earlier occurrence of its "
            "last 2–4 tokens), feeds them with its pending token in one forward and keeps those the engine would "
            "have chosen anyway, position by position (the same sampler, penalties, grammar and stop checks; a "
            "sampled token is kept only when it equals the guess). Output as without it in fp32 (logits of a "
            "several-token forward round differently, as a batch's do; in bf16 that changes some outputs, as "
            "batching does). Pays on text that repeats its prompt (at one stream "
            "here: quoting 3.2x tok/s, renaming in code 2.7x, correcting a list 1.8x, a summary 1.1x), costs "
            "~3 % where nothing repeats (a row whose guesses keep failing pauses); batches of more rows decode as "
            "usual. Counted in `GET /models/<m>` (`engine.speculation`) and the "
            "`lmi_serve:spec_decode_*` metrics. A draft model id is refused (not served); rolling batch, decoder-"
            "only models, not with tensor parallelism"
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
