"""The validated configuration objects: one `ModelConfig` per served model and the `ServerConfig`
around them, immutable, with the choices and cross-field rules every value must meet.

Where the values come from (serving.properties, `OPTION_*` and the other environment variables,
the model store, SageMaker's mount) is config/sources.py's business; it builds these and re-exports them,
so the rest of the code imports everything from `config`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lmi_serve.config import chat_template
from lmi_serve.config.security import SecurityConfig

Dtype = Literal["fp32", "fp16", "bf16", "auto"]
RollingBatch = Literal["auto", "scheduler", "disable"]
# slots: preallocated buffers written in place (engine/kv/slots.py); dynamic: transformers' DynamicCache,
# concatenated every step (kv/dynamic.py), the baseline and a fallback. Encoder-decoders have their own.
KvCache = Literal["slots", "dynamic"]
# The layout a decoder-only model gets when nothing names one: the server's option and the engine's
# default (engine/kv/select.py) both read this, so tests run what the server runs.
DEFAULT_KV_CACHE: KvCache = "slots"
# Draft tokens per step of n-gram speculation when option.spec_length is 0 (engine/speculation.py reads it too).
DEFAULT_SPEC_LENGTH = 4
# Opt-in lighter weights (kernels/layers/quantize.py): none = the weights as loaded; fp16 = fp16-stored weights,
# fp32 compute; q4 = the GGUF's own 4-bit blocks (a Q4_0 / Q4_1 GGUF only), computed in the model's dtype
# (fp32, or bf16: the int4 kernel's fast path). CPU only.
Quantize = Literal["none", "fp16", "q4"]
# fp32 Linear layers on the CPU (kernels/layers/linear_kernels.py): auto = oneDNN's packed weights where they apply
# (fp32, CPU, torch built with oneDNN), else torch's; onednn = that or a start-up error; torch = nn.Linear (MKL).
LinearKernel = Literal["auto", "onednn", "torch"]
# One to eight fp32 rows (decode steps of a few streams) on a kernel of our own over a second copy of the weights,
# the bits of oneDNN's batched kernel (kernels/cpu/row_kernel.py): auto = where the copies fit in a quarter of the memory.
RowKernel = Literal["auto", "on", "off"]
# A decode step's attention (kernels/cpu/decode_kernel.py): auto = the CPU kernel (fp32, bf16) where it applies, else
# torch's SDPA; sdpa = torch's SDPA everywhere.
DecodeAttention = Literal["auto", "sdpa"]
# The LoRA matrices' dtype (model/lora.py): auto = the model's.
LoraDtype = Literal["auto", "fp32", "fp16", "bf16"]
# How a reasoning model's output splits into reasoning and answer (dialects/common/reasoning.py): auto =
# `<think>` markers where the chat template or the vocabulary has them; none = all answer; vLLM's parser names.
ReasoningParser = Literal["auto", "none", "deepseek_r1", "qwen3"]
# text2text-generation: encoder-decoder models (T5, BART), served by the text-generation handler and routes.
# tensor: a model.py serving tensors (Triton).
Task = Literal["text-generation", "text2text-generation", "text-embedding", "text-classification", "tensor"]
# How a chat model writes tool calls (dialects/openai/tool_formats/, vLLM's names); unset: from the chat template.
ToolCallParser = Literal["hermes", "llama3_json", "mistral", "pythonic"]
_CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": get_args(Dtype), "rolling_batch": get_args(RollingBatch), "task": get_args(Task),
    "kv_cache": get_args(KvCache), "quantize": get_args(Quantize), "linear_kernel": get_args(LinearKernel),
    "row_kernel": get_args(RowKernel), "decode_attention": get_args(DecodeAttention),
    "lora_dtype": get_args(LoraDtype), "reasoning_parser": get_args(ReasoningParser),
    "tool_call_parser": get_args(ToolCallParser),
}
# What each kind of model cannot honour: field -> why. The one declaration of it: config/sources.py refuses
# such an option, naming it, when the user set it for that model, and ignores it (with a log line)
# when an OPTION_* variable set it for every model of a store; a handler refuses it for a model
# whose kind is only decided at load (options_not_taken).
NOT_TAKEN: dict[str, dict[str, str]] = {
    "text-generation": {},
    "text2text-generation": {
        "enable_prefix_caching": "an encoder-decoder model's KV cache cannot start a row from a cached prefix",
        "enable_lora": "LoRA adapters are served on decoder-only models",
        "draft_model_id": "an encoder-decoder model's KV cache cannot verify draft tokens",
    },
    "text-embedding": {"quantize": "text generation only", "enable_prefix_caching": "text generation only",
                       "chat_template": "text generation only",
                       "trust_request_chat_template": "text generation only",
                       "draft_model_id": "text generation only", "decode_attention": "text generation only",
                       "mixed_steps": "text generation only", "row_kernel": "text generation only"},
    "text-classification": {"quantize": "text generation only", "enable_prefix_caching": "text generation only",
                            "chat_template": "text generation only",
                            "trust_request_chat_template": "text generation only",
                            "draft_model_id": "text generation only", "decode_attention": "text generation only",
                            "mixed_steps": "text generation only", "row_kernel": "text generation only"},
    "tensor": {},
}
KIND_NAMES = {"text2text-generation": "encoder-decoder", "text-embedding": "embedding",
              "text-classification": "classification"}  # in messages
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")
_NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"
_SECRET_KEY = re.compile(r"token|secret|password|api_key|credential", re.IGNORECASE)
DEFAULT_MAX_REQUEST_SIZE = 64 * 1024 * 1024


class ConfigError(ValueError):
    """Invalid or missing configuration; the message starts with the offending key."""


class _FieldError(ValueError):
    """A cross-field failure that remembers which field to blame, so its source key can be named."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _parse_bool(value: Any, *, also_true: tuple[str, ...] = ()) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE or text in also_true:
        return True
    if text in _FALSE:
        return False
    extra = "".join(f", {t}" for t in also_true)
    raise ValueError(f"is not a boolean (use true/false, 1/0, yes/no{extra})")


def _text(value: Any) -> str:
    """Render a resolved value the way a properties file would spell it."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def options_not_taken(config: "ModelConfig", task: str) -> list[tuple[str, str]]:
    """(field, "not available for <kind> models (why)") for each option `config` sets that a
    `task` model does not take (NOT_TAKEN)."""
    return [(field, f"not available for {KIND_NAMES.get(task, task)} models ({why})")
            for field, why in NOT_TAKEN.get(task, {}).items()
            if getattr(config, field) != ModelConfig.model_fields[field].default]


def tensor_parallel_conflict(config: "ModelConfig", degree: int) -> str | None:
    """Why `config` cannot run sharded over `degree` ranks (model/tp.py), or None. The followers replay
    only the KV cache's model calls (engine/kv/replicate.py): what rewrites or reads rank 0's layers or
    K/V alone cannot follow. `max` is checked once the server knows how many ranks it means."""
    if degree <= 1:
        return None
    refused = [("option.device_map", config.device_map is not None),
               ("option.enable_prefix_caching", config.enable_prefix_caching),
               ("option.enable_lora", config.enable_lora),
               ("option.draft_model_id", config.draft_model_id is not None),
               (f"option.quantize={config.quantize}", config.quantize != "none"),
               ("option.linear_kernel=onednn", config.linear_kernel == "onednn"),
               ("option.row_kernel=on", config.row_kernel == "on"),
               ("option.rolling_batch=disable", config.rolling_batch == "disable")]
    names = [name for name, on in refused if on]
    if not names:
        return None
    return (f"tensor_parallel_degree={degree} cannot be combined with {', '.join(names)} (tensor parallelism "
            "replays only the KV cache's model calls on the other ranks); use tensor_parallel_degree=1 for them")


class ModelConfig(BaseModel):
    """One served model, fully resolved; immutable so workers can share it without surprises."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    name: str = Field(
        pattern=_NAME_PATTERN,
        description="the served name (a model store always uses folder names)",
        json_schema_extra={"doc_default": "folder name"},
    )
    model_dir: str | None = None
    model_id: str | None = Field(
        None,
        description=(
            "local folder, GGUF file, `package:<python_module>[/sub]`, a Hub id or `s3://bucket/prefix` "
            "(downloaded at start-up, see [Bring your own model](models.md#bring-your-own-model))"
        ),
        json_schema_extra={"doc_default": "the folder itself"},
    )
    gguf_file: str | None = Field(
        None,
        description="which GGUF file in the folder",
        json_schema_extra={"doc_default": "the only `*.gguf`"},
    )
    dtype: Dtype = Field(
        "auto",
        description=(
            "`fp32`, `fp16`, `bf16`, `auto`: on a CPU fp32, exact. `bf16` on a CPU is the opt-in fast path where "
            "the CPU computes bf16 in hardware (avx512_bf16 or AMX): Linear layers on oneDNN's bf16 matmul (see "
            "`option.linear_kernel`), not exact (quality gates in benchmarks/journal/2026-11.md); elsewhere it is emulated "
            "and slower. On a GPU the "
            "checkpoint's own dtype (config.json's `torch_dtype`: fp16, bf16 or fp32; fp16 when it declares none, "
            "as DJL LMI), except bf16 on a GPU below compute capability 8.0 (T4, V100 only emulate it): fp16 "
            "there. Start-up logs the choice and why"
        ),
    )
    device_map: str | None = Field(
        None,
        description=(
            "passed to `from_pretrained` (GPU only): `auto` spreads the layers of a model without a "
            "tensor-parallel plan over the GPUs"
        ),
    )
    tensor_parallel_degree: int | Literal["max"] = Field(
        1,
        description=(
            "int or `max`/-1 (every GPU; 1 on a CPU); > 1 shards the model over that many ranks (see [Tensor "
            "parallelism](models.md#tensor-parallelism))"
        ),
    )
    trust_remote_code: bool = Field(
        False,
        description=(
            "let transformers run Python code the model's repo ships (`trust_remote_code`); see "
            "[Security](security.md)"
        ),
    )
    revision: str | None = Field(
        None,
        description="the Hub branch, tag or commit to download",
        json_schema_extra={"doc_default": "`main`"},
    )
    # A Hub or S3 model with only *.bin / *.pt / *.pth / *.ckpt weights (unpickling runs code): refused unless set
    allow_pickled_weights: bool = Field(
        False,
        description=(
            "a Hub or S3 model whose only weights are pickled (`*.bin`, `*.pt`, `*.pth`, `*.ckpt`) is downloaded "
            "and loaded instead of refused"
        ),
    )
    task: Task | None = Field(
        None,
        description=(
            "`text-generation`, `text2text-generation` (an encoder-decoder model; served by the same routes), "
            "`text-embedding`, `text-classification` (a `*ForSequenceClassification` model: rerankers, "
            "classifiers) or `tensor` (a model.py serving tensors, see Triton); inferred from the model's own"
            " files, see [Bring your own model](models.md#bring-your-own-model)"
        ),
        json_schema_extra={"doc_default": "inferred"},
    )
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
    quantize: Quantize = Field(
        "none",
        description=(
            "opt-in lighter weights, CPU only (`none` is today's output). `fp16`: every "
            "Linear (lm_head too) stores its weights in fp16 and computes in fp32 (fbgemm); a tied embedding "
            "keeps its fp32 weight. Perplexity 23.7155 against 23.7171, 10/10 greedy continuations identical to "
            "fp32 here, weights 513 → 256 MiB, a step 0.59–0.85x of fp32 on an AVX2 EPYC. `q4`: the GGUF's own "
            "Q4_0/Q4_1 blocks on torch's int4 kernel (every packed layer is checked against the loaded weights; "
            "q/k/v and gate/up stacked into one int4 layer each; layers the GGUF holds in another type, such as "
            "SmolLM2's Q8_0 tied lm_head, keep their loaded weights): weights 405 → 76 MiB. With "
            "`option.dtype=bf16` the activations are bf16 (up to 8 rows on kernels/cpu/q4_kernel.py where the CPU has "
            "AVX-512 BF16, the GGUF's fp16 scales exact; else torch's int4 kernel's vector path), and more than 8 rows "
            "(prefill, larger batches) go to a bf16 oneDNN copy of the weights (on a CPU that computes bf16; "
            "weights 265 MiB); on a CPU with AVX-512 VNNI the Q8_0 layers run their own blocks at one or two "
            "rows (int16 activations; SmolLM2's lm_head: a one-row step ~0.9x): the fastest decode at a few "
            "streams here (a one-row step ~0.7x of bf16's, ~0.45x "
            "of the fp32 default's on an avx512_bf16 EPYC; level with bf16 at 32 rows), not exact and not "
            "batch-invariant (bf16's rounding; gates in docs/models.md). With fp32 "
            "activations it is exact relative to the GGUF but torch 2.13's int4 kernel runs a scalar loop there, "
            "4.6–42x *slower* than fp32 (start-up warns): memory, not time. Refused, naming the option: "
            "`fp16` with `option.dtype` fp16/bf16, `q4` with fp16, either on a GPU, or `q4` for a model that "
            "is not a Q4 GGUF. No `int8` (see the fast-engine notes)"
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
    decode_attention: DecodeAttention = Field(
        "auto",
        description=(
            "the attention of a decode step. `auto`: for an fp32 or bf16 model on the CPU, a "
            "kernel of its own (kernels/cpu/decode_kernel.py, compiled by numba at start-up): each key and value "
            "read once, padding skipped, a row's result independent of its batch; 0.90x / 0.78x / 0.72x the step "
            "time of torch's SDPA at 32 rows of 200 / 800 / 2,000 tokens in fp32, 0.79-0.94x at 32 rows of 200 in "
            "bf16, 0.75x its time a call at one row (2-core EPYC). Within float rounding of SDPA's result. "
            "Elsewhere, or where numba's OpenMP layer cannot load (logged at start-up), torch's SDPA. `sdpa`: "
            "torch's SDPA always"
        ),
    )
    linear_kernel: LinearKernel = Field(
        "auto",
        description=(
            "the kernel of fp32 Linear layers on the CPU. `auto`: oneDNN's matmul on weights reordered once into "
            "its blocked layout (kernels/layers/linear_kernels.py; a decoder's q/k/v and gate/up stacked into one matmul "
            "each, the same bits: kernels/layers/shared_input.py; RMSNorm layers on `F.rms_norm` where a probe finds the "
            "same bits, with either kernel: kernels/layers/fused_norms.py; and with either kernel on the CPU, Llama, Qwen2 and "
            "Qwen3 decoder layers in fewer ops, the same bits: kernels/layers/lean_layers.py) wherever the model is fp32 "
            "on the CPU (or bf16 on a CPU with avx512_bf16 or AMX), else torch's own; `onednn`: that, or a "
            "start-up error naming the option (a GPU, fp16, bf16 the CPU only emulates); `torch`: `nn.Linear` "
            "as loaded (MKL's sgemm), the path before. Still fp32 arithmetic: logits differ from MKL's only in "
            "summation order (~1e-6), perplexity 23.4280 both, 10/10 greedy continuations identical; a decode "
            "step 0.51–0.59x of `torch`'s at 1–32 rows here (Zen 5 EPYC). Applies after `option.quantize` (its "
            "fp16/int4 layers are not `nn.Linear`; the fp32 ones it keeps are swapped) and to embedding models "
            "too"
        ),
    )
    row_kernel: RowKernel = Field(
        "auto",
        description=(
            "where option.linear_kernel puts fp32 Linear layers on oneDNN: one to 64 rows (decode steps of up "
            "to 64 streams) on a kernel of our own (kernels/cpu/row_kernel.py) over a second copy of the weights laid "
            "out for it, with the bits oneDNN gives those rows in any batch (its block size probed per layer at "
            "start-up; a layer where none matches keeps oneDNN). `auto`: where the copies take at most a quarter "
            "of the memory available at start-up (the default model: +513 MiB); `on`: always; `off`: no copy. "
            "The default's decode step 0.70x / 0.71x / 0.79x / 0.92x its time on oneDNN alone at 1 / 4 / 8 / 32 "
            "rows, the served one-stream TPOT 20.9 against 35.2 ms (2-core EPYC, benchmarks/journal/2026-11.md). Text "
            "generation only"
        ),
    )
    # LoRA adapters (model/lora.py, engine/adapters.py): <model_dir>/adapters/* at start-up, the adapters API
    enable_lora: bool = Field(
        False,
        description=(
            "serve LoRA adapters on this model: every sub-folder of `<model dir>/adapters/` holding a PEFT "
            "adapter is registered at start-up under its folder's name, more through the adapters API; requests "
            "name theirs per dialect (see [LoRA adapters](models.md#lora-adapters)). Rolling batch, decoder-only "
            "models, one worker (start-up errors otherwise)"
        ),
    )
    max_loras: int = Field(
        4, ge=1,
        description=(
            "adapters resident at once; registering or requesting another evicts the least recently used one that"
            " no running row uses (read again from its folder when needed)"
        ),
    )
    max_lora_rank: int = Field(
        64, ge=1,
        description=(
            "an adapter of a larger rank is refused at registration (400; a start-up error for the adapters "
            "folder)"
        ),
    )
    lora_dtype: LoraDtype = Field(
        "auto",
        description="the LoRA matrices' dtype: `auto` (the model's), `fp32`, `fp16`, `bf16`",
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
    enable_streaming: bool = Field(
        False,
        description="`true`/`huggingface`: jsonlines `{\"outputs\": [...]}` (needs `batch_size=1`)",
    )
    output_formatter: str | None = Field(None, description="`json`, `jsonlines`, `sse` (rolling batch)")
    tgi_compat: bool = Field(False, description="TGI-shaped bodies and errors on the LMI routes (rolling batch)")
    reasoning_parser: ReasoningParser = Field(
        "auto",
        description="chat: the reasoning block returned as `reasoning_content` (`auto`: `<think>` markers when "
                    "the chat template or vocabulary has them; `deepseek_r1`/`qwen3`: those markers; `none`: off)",
    )
    max_reasoning_tokens: int | None = Field(
        None, ge=1,
        description="chat: most tokens in a reasoning block (the markers must be tokens); a request's "
                    "`thinking_token_budget` may lower it",
        json_schema_extra={"doc_default": "unbounded"},
    )
    tool_call_parser: ToolCallParser | None = Field(
        None,
        description="the format chat models write tool calls in (vLLM's parser names; see the OpenAI page)",
        json_schema_extra={"doc_default": "from the chat template, else `hermes`"},
    )
    chat_template: str | None = Field(
        None,
        description="the chat template every route renders messages with, instead of the checkpoint's: a file "
                    "(relative: in the model folder, else the working directory) or the Jinja text itself (a "
                    "value with `{`, `}` or a line break); a file that is not there is a start-up error",
        json_schema_extra={"doc_default": "the checkpoint's"},
    )
    trust_request_chat_template: bool = Field(
        False,
        description="honour a chat request's own `chat_template` (vLLM's `--trust-request-chat-template`); "
                    "off, such a request is a 400. The client's Jinja then runs in transformers' sandbox",
    )
    limit_mm_per_prompt: int = Field(
        4, ge=0,
        description="vision-language models: most images per chat request (`4` or LMI's `image=4`); more is a 400",
    )
    image_fetch: Literal["off", "public", "any"] = Field(
        "off",
        description="vision-language models: fetch http(s) image URLs: `off` (data URIs only), `public` (no "
                    "private, loopback or link-local address), `any` (an in-cluster image store too)",
    )
    image_fetch_timeout: float = Field(
        10.0, gt=0, le=300,
        description="vision-language models: seconds one image URL may take to download (connect and read)",
    )
    entry_point: str | None = Field(
        None,
        description="handler file (path, or file in the model folder) or module",
        json_schema_extra={"doc_default": "`model.py` in the folder, else built-in"},
    )
    handler: str = Field("handle", description="handler function name")
    predict_timeout: float = Field(
        120.0, gt=0,
        description=(
            "seconds a request may wait + run (dynamic batch); may wait for a free row (rolling batch: once "
            "generating, it runs to the end)"
        ),
    )
    model_loading_timeout: float = Field(240.0, gt=0, description="seconds before a loading model counts as failed")
    job_queue_size: int = Field(1000, ge=1, description="waiting requests per model before 503 (TGI routes: 429)")
    max_input_len: int | None = Field(
        None, ge=1,
        description="prompt tokens allowed",
        json_schema_extra={"doc_default": "context − 1"},
    )
    max_model_len: int | None = Field(
        None, ge=1,
        description="prompt + output tokens",
        json_schema_extra={"doc_default": "the model's context"},
    )
    min_workers: int = Field(1, ge=0, description="validated; replicas are server-wide (below)")
    max_workers: int = Field(1, ge=1, description="validated; replicas are server-wide (below)")
    options: dict[str, str] = Field(default_factory=dict)
    unknown_options: tuple[str, ...] = ()
    # OPTION_* variables left out for this model: its kind does not take them (NOT_TAKEN)
    ignored_options: tuple[str, ...] = ()

    @field_validator("dtype", "rolling_batch", "task", "kv_cache", "quantize", "linear_kernel", "row_kernel",
                     "decode_attention",
                     "lora_dtype", "reasoning_parser", "tool_call_parser", mode="before")
    @classmethod
    def _choice(cls, value: Any, info: Any) -> Any:
        if value is None:
            return None
        choices = _CHOICES[info.field_name]
        text = str(value).strip().lower()
        if text not in choices:
            raise ValueError(f"is not one of {', '.join(choices)}")
        return text

    @field_validator("trust_remote_code", "tgi_compat", "enable_lora", "allow_pickled_weights",
                     "trust_request_chat_template", mode="before")
    @classmethod
    def _flag(cls, value: Any) -> bool:
        return _parse_bool(value)

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, value: str | None, info: Any) -> str | None:
        """Inline text as given; a file name as its absolute path, which must exist (config/chat_template.py)."""
        return None if value is None else chat_template.resolve(value, info.data.get("model_dir"))

    @field_validator("enable_prefix_caching", mode="before")
    @classmethod
    def _flag_or_unset(cls, value: Any) -> bool | None:
        return None if value is None else _parse_bool(value)

    @field_validator("limit_mm_per_prompt", mode="before")
    @classmethod
    def _images_limit(cls, value: Any) -> Any:
        """LMI / vLLM write it per modality (`image=4`, or JSON `{"image": 4}`); only images are served."""
        text = _text(value).strip().strip("{}").replace('"', "").replace(":", "=")
        if "=" not in text:
            return value
        limits = dict(item.split("=", 1) for item in text.split(",") if item.strip())
        limits = {k.strip(): v.strip() for k, v in limits.items()}
        if set(limits) - {"image"}:
            raise ValueError(f"names {', '.join(sorted(set(limits) - {'image'}))}: only `image` inputs are served")
        return limits.get("image", 4)

    @field_validator("draft_model_id", mode="before")
    @classmethod
    def _draft(cls, value: Any) -> Any:
        """`ngram`, or vLLM's older spelling `[ngram]`; a model id is refused, naming what is served."""
        if value is None:
            return None
        text = _text(value).strip().lower().strip("[]")
        if text != "ngram":
            raise ValueError("is not served: only `ngram` is (speculation by prompt lookup; a draft model is not "
                             "supported)")
        return text

    @field_validator("enable_streaming", mode="before")
    @classmethod
    def _streaming(cls, value: Any) -> bool:
        return _parse_bool(value, also_true=("huggingface",))  # LMI's legacy spelling of "true"

    @field_validator("tensor_parallel_degree", mode="before")
    @classmethod
    def _tp(cls, value: Any) -> int | str:
        text = str(value).strip().lower()
        if text in ("max", "-1"):
            return "max"
        try:
            degree = int(text)
        except ValueError:
            degree = 0
        if degree < 1:
            raise ValueError("must be an integer >= 1, 'max' or -1")
        return degree

    @model_validator(mode="after")
    def _cross_field(self) -> ModelConfig:
        for field, reason in options_not_taken(self, self.task) if self.task else ():
            raise _FieldError(field, reason)
        if self.enable_streaming and self.batch_size > 1:
            raise _FieldError("enable_streaming", "We cannot enable streaming for dynamic batching "
                              f"(batch_size is {self.batch_size}; set it to 1 or disable streaming)")
        if self.enable_prefix_caching and self.rolling_batch == "disable":
            raise _FieldError("enable_prefix_caching", "prefix caching needs the rolling batch; "
                              "this model has option.rolling_batch=disable")
        if self.enable_lora and self.rolling_batch == "disable":
            raise _FieldError("enable_lora", "LoRA adapters need the rolling batch; "
                              "this model has option.rolling_batch=disable")
        self._check_speculation()
        if self.quantize == "q4" and self.dtype == "fp16":
            raise _FieldError("quantize", "option.quantize=q4 computes in fp32 or bf16 (the int4 kernel's fast "
                              "path); option.dtype=fp16 cannot be combined with it (use bf16, fp32 or auto)")
        if self.quantize == "fp16" and self.dtype in ("fp16", "bf16"):
            raise _FieldError("quantize", f"option.quantize={self.quantize} computes in fp32 from fp32-loaded "
                              f"weights; option.dtype={self.dtype} cannot be combined with it (use fp32 or auto)")
        degree = self.tensor_parallel_degree
        conflict = tensor_parallel_conflict(self, degree) if isinstance(degree, int) else None
        if conflict:
            raise _FieldError("tensor_parallel_degree", conflict)
        if self.max_workers < self.min_workers:
            raise _FieldError("max_workers", f"max_workers ({self.max_workers}) is less than "
                              f"min_workers ({self.min_workers})")
        return self

    def _check_speculation(self) -> None:
        if self.draft_model_id is None:
            if self.spec_length:
                raise _FieldError("spec_length", "draft tokens need option.draft_model_id=ngram")
            return
        if self.rolling_batch == "disable":
            raise _FieldError("draft_model_id", "speculation needs the rolling batch; "
                              "this model has option.rolling_batch=disable")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise _FieldError("prompt_lookup_min", f"option.prompt_lookup_min ({self.prompt_lookup_min}) is more "
                              f"than option.prompt_lookup_max ({self.prompt_lookup_max})")

    def handler_properties(self) -> dict[str, str]:
        """DJL-style init properties: raw options overlaid with every resolved (typed) value."""
        props = dict(self.options)
        for field, value in self.model_dump(exclude={"options", "unknown_options", "ignored_options"}).items():
            if value is not None:
                props[field] = _text(value)
        return props

    @classmethod
    def from_handler_properties(cls, props: Mapping[str, str]) -> ModelConfig:
        """The inverse of :meth:`handler_properties`: DJL-style string properties validated back
        into a ModelConfig (keys that name no field stay in ``options``). For a built-in handler
        reached through DJL's first ``handle()`` call, e.g. from a user's model.py delegating to it.
        Without ``name`` (or DJL's ``model_name``) the model is called ``model``."""
        fields = set(cls.model_fields) - {"options", "unknown_options", "ignored_options"}
        values: dict[str, Any] = {k: v for k, v in props.items() if k in fields and v not in (None, "")}
        values.setdefault("name", props.get("model_name") or "model")
        values["options"] = {k: str(v) for k, v in props.items() if k not in fields}
        return _validated(lambda: cls.model_validate(values), values, {})


class ServerConfig(BaseModel):
    """Process-wide settings plus every model; serialised to JSON for the worker processes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=1, le=65535)
    workers: int = Field(1, ge=1)
    threads: int = Field(64, ge=1)
    max_request_size: int = Field(DEFAULT_MAX_REQUEST_SIZE, ge=1)
    request_id_header: str = "x-request-id"
    cache_dir: str = Field(default_factory=lambda: os.path.expanduser("~/.cache/lmi-serve"))
    triton_server_name: str = Field("triton", min_length=1)  # GET /v2 "name" (Triton's scripts check it)
    # OpenAI routes: an unknown `model` is a 404 even when one text-generation model is served (vLLM)
    strict_model_names: bool = False
    # SIGTERM: seconds in-flight requests and streams get to finish before they end with an error (drain.py)
    graceful_timeout: float = Field(30.0, gt=0)
    # Access control (security.py): API keys (digests only), the management switch, the adapters root
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    # SageMaker multi-model endpoints (serving/multi_model.py): models loaded and unloaded at run time
    # through POST / DELETE /models; the store may start empty
    multi_model: bool = False
    mme_memory_limit: int | None = Field(None, ge=1)  # bytes the models may take; None: 85% of the container's
    model_url_root: str = "/opt/ml/models"  # the folder POST /models may load from (SageMaker's)
    models: tuple[ModelConfig, ...] = ()

    @field_validator("models")
    @classmethod
    def _unique_names(cls, models: tuple[ModelConfig, ...]) -> tuple[ModelConfig, ...]:
        names = [m.name for m in models]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate model names: {', '.join(duplicates)}")
        return models

    @model_validator(mode="after")
    def _models_or_multi_model(self) -> ServerConfig:
        if not self.models and not self.multi_model:
            raise _FieldError("models", "no model to serve (only a multi-model endpoint, SAGEMAKER_MULTI_MODEL=true, "
                                        "may start with none)")
        # Every worker process holds its own copy of every model, and a load or unload reaches the one
        # worker that answers it: with several, they would disagree on what is loaded. One worker with
        # torch's threads on every core already uses the CPU and batches across requests.
        if self.multi_model and self.workers > 1:
            raise _FieldError("workers", f"a multi-model endpoint (SAGEMAKER_MULTI_MODEL) needs a single worker: a "
                                         f"model is loaded into the worker that answers POST /models, and workers is "
                                         f"{self.workers}")
        return self

    @model_validator(mode="after")
    def _one_worker_for_lora(self) -> ServerConfig:
        # The adapters API changes one process's adapters; several replicas would disagree on them.
        lora = [m.name for m in self.models if m.enable_lora]
        if lora and self.workers > 1:
            raise _FieldError("workers", f"option.enable_lora (model {lora[0]}) needs a single worker: the adapters API "
                             f"registers an adapter in the worker that answers it, and workers is {self.workers}")
        return self

    def describe(self) -> str:
        """Every resolved value, one per line, for the single startup log record."""
        lines = ["lmi-serve configuration:"]
        lines += [f"  {k} = {v}" for k, v in self.model_dump(exclude={"models", "security"}).items()]
        lines += self.security.describe()
        for model in self.models:
            lines.append(f"  model {model.name!r}:")
            for field, value in model.model_dump(exclude={"name", "options", "unknown_options",
                                                          "ignored_options"}).items():
                lines.append(f"    {field} = {'-' if value is None else _text(value)}")
            shown = {k: "****" if _SECRET_KEY.search(k) else v for k, v in model.options.items()}
            lines.append(f"    options = {', '.join(f'{k}={v}' for k, v in sorted(shown.items())) or '-'}")
            if model.unknown_options:
                unknown = ", ".join(model.unknown_options)
                lines.append(f"    unknown options (custom handlers only) = {unknown}")
            if model.ignored_options:
                lines.append(f"    ignored (not for {KIND_NAMES.get(model.task or '', model.task)} models) = "
                             f"{', '.join(model.ignored_options)}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, s: str) -> ServerConfig:
        return _validated(lambda: cls.model_validate_json(s), {}, {})


_REASONS = {  # pydantic error type -> our wording (formatted with the error's ctx)
    "greater_than_equal": "must be >= {ge}", "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}", "too_short": "must not be empty", "value_error": "{error}",
    "int_parsing": "is not an integer", "int_from_float": "is not an integer",
    "int_type": "is not an integer", "float_parsing": "is not a number", "float_type": "is not a number",
    "string_pattern_mismatch": "is not a valid name (use letters, digits, '_', '.', '-')",
}


def _validated(build: Callable[[], Any], raws: Mapping[str, Any], keys: Mapping[str, str],
               default_key: Callable[[str], str] = lambda field: field) -> Any:
    """Run a pydantic build, re-raising failures as ConfigError naming each source key."""
    try:
        return build()
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            ctx = err.get("ctx") or {}
            blamed = getattr(ctx.get("error"), "field", None)
            field = blamed or ".".join(str(p) for p in err["loc"])
            key = keys.get(field) or default_key(field)
            reason = _REASONS[err["type"]].format(**ctx) if err["type"] in _REASONS else err["msg"]
            if blamed or not err["loc"]:
                lines.append(f"{key}: {reason}")
            else:
                lines.append(f"{key}: {raws.get(field, err.get('input'))!r} {reason}")
        raise ConfigError("\n".join(lines)) from None
