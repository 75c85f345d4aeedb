"""Options for the kernels that run a layer's forward on the CPU: lighter weights, the Linear layers'
kernel, the row kernel for a decode step's few rows, and decode attention. One concern of `ModelConfig`
(config/models.py assembles them). Each opt-in is measured and gated in docs/models.md ("Faster on a CPU");
which kernel takes how many rows is the kernels' business, not stated here."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import Field, field_validator

from lmi_serve.config.fields import FAST_CPU, JOURNAL, RESULTS, Options, choice

# Opt-in lighter weights, CPU only: none = the weights as loaded; fp16 = fp16-stored weights, fp32 compute;
# q4 = the GGUF's own 4-bit blocks (Q4_0 / Q4_1 / Q4_K tensors only), computed in the model's dtype (fp32, or bf16).
Quantize = Literal["none", "fp16", "q4"]
# fp32 Linear layers on the CPU: auto = oneDNN's packed weights where they apply (fp32, CPU, torch built with
# oneDNN), else torch's; onednn = that or a start-up error; torch = nn.Linear (MKL).
LinearKernel = Literal["auto", "onednn", "torch"]
# A decode step's few fp32 rows on a kernel of our own over a second copy of the weights, with the bits of
# oneDNN's batched kernel: auto = where the copies fit in a quarter of the memory.
RowKernel = Literal["auto", "on", "off"]
# A decode step's attention: auto = the CPU kernel (fp32, bf16) where it applies, else torch's SDPA;
# sdpa = torch's SDPA everywhere.
DecodeAttention = Literal["auto", "sdpa"]
_CHOICES = {"quantize": get_args(Quantize), "linear_kernel": get_args(LinearKernel),
            "row_kernel": get_args(RowKernel), "decode_attention": get_args(DecodeAttention)}

# The journal's sections behind the figures of these options
_ONEDNN = f"{JOURNAL}#the-fast-engine-fp32-linear-layers-on-onednn-2026-11-24-third-session"
_ROWS = (f"{JOURNAL}#the-row-kernel-to-64-rows-a-two-row-q4-loop-kernels-that-must-compile-the-gaps-workload-on-"
         "this-box-issue-33-2026-11-28-21552250-utc")
_DECODE = f"{JOURNAL}#a-decode-attention-kernel-of-our-own-issue-33-item-3-2026-11-27-16001715-utc-quiet-box"


class KernelOptions(Options):
    """Which kernels a model's layers run on."""

    quantize: Quantize = Field(
        "none",
        description=(
            "lighter weights, CPU only. `none`: as loaded; `fp16`: fp16-stored Linear weights, fp32 "
            "arithmetic; `q4`: the checkpoint's own quantized weights (GGUF Q4/Q5_0/Q6_K/Q8_0, AWQ, GPTQ, "
            "compressed-tensors int4/int8) on our int4/int8 kernels, fast with `option.dtype=bf16`, much slower in "
            "fp32. Refused, naming the option, on a GPU or an unsupported checkpoint "
            f"([Faster on a CPU]({FAST_CPU}), [formats](models.md#pre-quantized-checkpoints-awq-gptq-compressed-"
            f"tensors), [figures]({RESULTS}#sweep-with-q4-weights))"
        ),
    )
    quantize_lm_head: bool = Field(
        False,
        description=(
            "with `option.quantize=q4` and `option.dtype=bf16` on a CPU with AVX-512 VNNI, an lm_head the "
            "checkpoint leaves unquantized (AWQ's always) is rounded at load to int8 blocks of 32 with an fp16 "
            "scale (llama.cpp's Q8_0, a GGUF's usual output type) on the int8 kernel: half bf16's bytes a step, "
            f"logits within that rounding ([formats](models.md#pre-quantized-checkpoints-awq-gptq-compressed-tensors))"
        ),
    )
    decode_attention: DecodeAttention = Field(
        "auto",
        description=(
            "the attention of a decode step. `auto`: for an fp32 or bf16 model on the CPU, a numba kernel of our "
            "own, within float rounding of SDPA and a row's result independent of its batch; elsewhere, or where "
            "numba's OpenMP layer cannot load (logged at start-up), torch's SDPA. `sdpa`: torch's SDPA always "
            f"([figures]({_DECODE}))"
        ),
    )
    linear_kernel: LinearKernel = Field(
        "auto",
        description=(
            "the kernel of fp32 Linear layers on the CPU (bf16 too where the CPU computes it). `auto`: oneDNN's "
            "matmul on weights reordered once, where it applies, else torch's; `onednn`: that, or a start-up error "
            "naming the option; `torch`: `nn.Linear` as loaded (MKL). Logits differ only in summation order; "
            f"applies after `option.quantize` and to embedding models too ([figures]({_ONEDNN}))"
        ),
    )
    row_kernel: RowKernel = Field(
        "auto",
        description=(
            "where `option.linear_kernel` puts fp32 layers on oneDNN, a decode step's few rows run on a kernel of "
            "our own over a second copy of the weights, with the bits oneDNN gives them in any batch. `auto`: "
            "where the copies take at most a quarter of the memory available at start-up; `on`: always; `off`: no "
            f"copy. Text generation only ([figures]({_ROWS}))"
        ),
    )

    @field_validator("quantize", "linear_kernel", "row_kernel", "decode_attention", mode="before")
    @classmethod
    def _kernel_choice(cls, value: Any, info: Any) -> Any:
        return choice(value, _CHOICES[info.field_name])
