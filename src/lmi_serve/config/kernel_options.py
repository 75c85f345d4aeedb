"""Options for the kernels that run a layer's forward on the CPU: lighter weights, the Linear layers'
kernel, the row kernel for a decode step's few rows, and decode attention. One concern of `ModelConfig`
(config/models.py assembles them)."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import Field, field_validator

from lmi_serve.config.fields import Options, choice

# Opt-in lighter weights (model/quantize.py): none = the weights as loaded; fp16 = fp16-stored weights,
# fp32 compute; q4 = the GGUF's own 4-bit blocks (a Q4_0 / Q4_1 GGUF only), computed in the model's dtype
# (fp32, or bf16: the int4 kernel's fast path). CPU only.
Quantize = Literal["none", "fp16", "q4"]
# fp32 Linear layers on the CPU (model/linear_kernels.py): auto = oneDNN's packed weights where they apply
# (fp32, CPU, torch built with oneDNN), else torch's; onednn = that or a start-up error; torch = nn.Linear (MKL).
LinearKernel = Literal["auto", "onednn", "torch"]
# One to eight fp32 rows (decode steps of a few streams) on a kernel of our own over a second copy of the weights,
# the bits of oneDNN's batched kernel (model/row_kernel.py): auto = where the copies fit in a quarter of the memory.
RowKernel = Literal["auto", "on", "off"]
# A decode step's attention (engine/kv/decode_kernel.py): auto = the CPU kernel (fp32, bf16) where it applies, else
# torch's SDPA; sdpa = torch's SDPA everywhere.
DecodeAttention = Literal["auto", "sdpa"]
_CHOICES = {"quantize": get_args(Quantize), "linear_kernel": get_args(LinearKernel),
            "row_kernel": get_args(RowKernel), "decode_attention": get_args(DecodeAttention)}


class KernelOptions(Options):
    """Which kernels a model's layers run on."""

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
            "`option.dtype=bf16` the activations are bf16 (up to 8 rows on model/q4_kernel.py where the CPU has "
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
    decode_attention: DecodeAttention = Field(
        "auto",
        description=(
            "the attention of a decode step. `auto`: for an fp32 or bf16 model on the CPU, a "
            "kernel of its own (engine/kv/decode_kernel.py, compiled by numba at start-up): each key and value "
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
            "its blocked layout (model/linear_kernels.py; a decoder's q/k/v and gate/up stacked into one matmul "
            "each, the same bits: model/shared_input.py; RMSNorm layers on `F.rms_norm` where a probe finds the "
            "same bits, with either kernel: model/fused_norms.py; and with either kernel on the CPU, Llama, Qwen2 and "
            "Qwen3 decoder layers in fewer ops, the same bits: model/lean_layers.py) wherever the model is fp32 "
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
            "to 64 streams) on a kernel of our own (model/row_kernel.py) over a second copy of the weights laid "
            "out for it, with the bits oneDNN gives those rows in any batch (its block size probed per layer at "
            "start-up; a layer where none matches keeps oneDNN). `auto`: where the copies take at most a quarter "
            "of the memory available at start-up (the default model: +513 MiB); `on`: always; `off`: no copy. "
            "The default's decode step 0.70x / 0.71x / 0.79x / 0.92x its time on oneDNN alone at 1 / 4 / 8 / 32 "
            "rows, the served one-stream TPOT 20.9 against 35.2 ms (2-core EPYC, benchmarks/journal/2026-11.md). Text "
            "generation only"
        ),
    )

    @field_validator("quantize", "linear_kernel", "row_kernel", "decode_attention", mode="before")
    @classmethod
    def _kernel_choice(cls, value: Any, info: Any) -> Any:
        return choice(value, _CHOICES[info.field_name])
