"""fp32 (and bf16) Linear layers on oneDNN's packed-weight kernel (`option.linear_kernel`): model surgery, no engine.

On CPU, `nn.Linear` in fp32 runs torch's `addmm`, which calls MKL's sgemm. For the shapes a decode step
has (a few to a few dozen rows against a weight matrix) oneDNN's matmul with the weight reordered once
into its own blocked layout is 1.3-3.7x faster (measured on a Zen 5 EPYC: the 49,152-row lm_head of
SmolLM2 at 32 rows 17.7 -> 4.7 ms, its MLP's 1536x576 at 32 rows 0.39 -> 0.13 ms; see benchmarks/journal/2026-11.md's fast
engine section for the whole step). The arithmetic stays fp32: the results differ from MKL's only in
the order in which a dot product is summed (~1e-6 on SmolLM2's activations), as MKL's own results
differ between one row and several. `torch` keeps the plain layers (the baseline, and a fallback).

A model loaded in bf16 (`option.dtype=bf16`, opt-in on a CPU) gets the same packing where the CPU computes
bf16 in hardware (avx512_bf16 or AMX, as oneDNN reports it): there oneDNN's bf16 matmul runs on AMX tiles or
bf16 dot-product instructions (one layer 2-3x fp32's speed at one row, ~4x at 32 rows on an AMX Xeon, where
torch's own bf16 `nn.Linear` is slower than fp32; a whole decode step 0.5-0.6x of fp32's at 8-32 rows:
benchmarks/journal/2026-11.md). bf16 is not exact, and its rows are not batch-invariant (a product's bf16 rounding
depends on the kernel oneDNN picks for the row count): that is the opt-in's price.

The swap runs on the loaded model, after option.quantize (whose fp16 / int4 layers are not nn.Linear
and are left alone), and only where the layer is fp32 (or bf16, natively computed) on the CPU and torch was
built with oneDNN.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from lmi_serve.kernels.host import bf16_native, onednn_available
from lmi_serve.kernels.layers.fused_norms import use_fused_norms
from lmi_serve.kernels.layers.lean_layers import use_lean_layers
from lmi_serve.kernels.cpu.row_kernel import MAX_ROWS, RowKernelReport, computes_rows_on_copy, use_row_kernel
from lmi_serve.kernels.layers.surgery import own_remaining_tensors, replace_module, return_freed_memory
from lmi_serve.kernels.layers.shared_input import SharedInputSlice, stack_shared_inputs

log = logging.getLogger(__name__)

KERNELS = ("auto", "onednn", "torch")
_PACK_ROWS = 32  # the row count oneDNN's weight layout is chosen for; any row count runs on it


class LinearKernelError(ValueError):
    """`option.linear_kernel` cannot apply to this model; the message says why and what to do."""


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes OneDnnLinear takes on this CPU."""
    return (torch.float32, torch.bfloat16) if bf16_native() else (torch.float32,)


@computes_rows_on_copy  # its forward of 1 to MAX_ROWS rows is its row-kernel copy's, where it has one
class OneDnnLinear(nn.Module):
    """`nn.Linear` in fp32 (or bf16) with its weight reordered once into oneDNN's blocked layout. Holds no
    plain weight (the packed one is opaque), so a tied output embedding keeps its own weight."""

    weight = None  # none to read: models that cast to `layer.weight.dtype` when it is a Tensor (T5) skip that

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        self._packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().contiguous(), _PACK_ROWS)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self._row_alone_differs = row_alone_differs(self._linear, self.in_features, self.out_features, self.dtype,
                                                    self.bias is not None)
        self._row_weights = None  # the row kernel's copy of the weights (kernels/cpu/row_kernel.py), where it was given

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:  # a caller that up/down-casts around a layer: keep its contract
            x = x.to(self.dtype)
        rows = x.numel() // x.shape[-1]
        if rows <= MAX_ROWS and self._row_weights is not None:  # the row kernel: oneDNN's batched bits, faster
            return self._row_weights(x)
        if rows == 1 and self._row_alone_differs:  # oneDNN's one-row kernel sums otherwise: computed as two
            return one_row_as_two(self._linear, x)
        return self._linear(x.contiguous())

    def use_row_kernel(self, weights) -> None:
        """Compute up to row_kernel.MAX_ROWS rows with the row kernel on `weights` (row_kernel.RowWeights, probed
        to give this layer's batched bits)."""
        self._row_weights = weights

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    def batched(self, x: torch.Tensor) -> torch.Tensor:
        """oneDNN's answer for contiguous rows `x`, whatever their count (the reference the row kernel matches)."""
        return self._linear(x)

    def dense_weight(self) -> torch.Tensor:
        """The weight [out, in] as a plain tensor (a copy: the packed one is opaque)."""
        return self._packed.to_dense()

    def stored_bytes(self) -> int:
        """Its packed weight and bias (kernels/footprint.py); the row kernel's copy is counted apart."""
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self._packed.numel() * self._packed.element_size() + bias

    def extra_repr(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel=onednn, {dtype}"


_ROW_ALONE_DIFFERS: dict[tuple, bool] = {}  # (in, out, dtype, bias, threads) -> probed answer


def row_alone_differs(linear, in_features: int, out_features: int, dtype: torch.dtype, bias: bool) -> bool:
    """Whether oneDNN answers one row of this shape with other bits than the same row gets beside another
    (then the layer takes `one_row_as_two`). Probed once per shape on this CPU and thread count, with
    random rows: oneDNN picks its kernel by shape, and another kernel's rounding shows on any input.
    Measured on an AVX-512 Xeon: the same kernel below 1,280 input features, another from there up;
    the copy and the second row cost a one-row step ~4 ms of ~50 (SmolLM2) where they were not needed."""
    key = (in_features, out_features, dtype, bias, torch.get_num_threads())
    if key not in _ROW_ALONE_DIFFERS:
        rows = torch.randn(3, in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
        with torch.no_grad():
            _ROW_ALONE_DIFFERS[key] = any(
                not torch.equal(linear(rows[i:i + 1]), linear(rows[i:i + 1].expand(2, -1).contiguous())[:1])
                for i in range(len(rows)))
    return _ROW_ALONE_DIFFERS[key]


def one_row_as_two(linear, x: torch.Tensor) -> torch.Tensor:
    """`linear` of a one-row `x`, computed on that row twice and the first result kept. For fp32 weights
    with 1,280 or more input features oneDNN takes another kernel for a single row, whose last bits differ
    from the same row's in any batch of 2 to 64 rows (benchmarks/journal/2026-11.md, "Choosing the Linear kernel
    per CPU"); a row decoding alone must answer what it answers in company. Two rows read the weights
    once, as one does."""
    flat = x.reshape(1, x.shape[-1])
    return linear(flat.expand(2, -1).contiguous())[:1].reshape(*x.shape[:-1], -1)


def on_onednn(module: nn.Module) -> bool:
    """A layer computed by oneDNN's packed kernel: a OneDnnLinear, or a slice of a stacked one."""
    return isinstance(module, (OneDnnLinear, SharedInputSlice))


@dataclass
class LinearKernelReport:
    """What a swap did: for the start-up log and the benchmarks."""

    kernel: str  # the kernel in use: onednn or torch
    dtype: str = "fp32"  # the swapped layers' weights: fp32, or bf16 (option.dtype=bf16 on a CPU that computes it)
    swapped: list[str] = field(default_factory=list)
    stacked: list[str] = field(default_factory=list)  # of `swapped`: siblings stacked into one matmul (shared_input.py)
    norms: list[str] = field(default_factory=list)  # RMSNorm layers on F.rms_norm, the same bits (fused_norms.py)
    lean: list[str] = field(default_factory=list)  # decoder layers in fewer ops, the same bits (lean_layers.py)
    row_kernel: RowKernelReport | None = None  # 1-64 rows on the row kernel, the same bits (row_kernel.py)
    kept: dict[str, str] = field(default_factory=dict)  # Linear module -> why it stays an nn.Linear
    seconds: float = 0.0

    def describe(self) -> str:
        norms = f"; {len(self.norms)} RMSNorm layers on F.rms_norm" if self.norms else ""
        norms += f"; {len(self.lean)} lean decoder layers" if self.lean else ""
        if self.kernel == "torch":
            return f"option.linear_kernel: torch's own nn.Linear (MKL sgemm in fp32){norms}"
        kept = "; ".join(f"{name} ({why})" for name, why in self.kept.items()) or "none"
        row_kernel = f"; {self.row_kernel.describe()}" if self.row_kernel is not None else ""
        return (f"option.linear_kernel=onednn: {len(self.swapped)} {self.dtype} Linear layers on oneDNN's packed weights "
                f"({len(self.stacked)} of them stacked with siblings of the same input) in {self.seconds:.1f} s; "
                f"kept: {kept}{norms}{row_kernel}")


def choose_kernel(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The kernel option.linear_kernel gives on this placement; refuses `onednn` where it cannot run."""
    if requested not in KERNELS:
        raise LinearKernelError(f"option.linear_kernel: {requested!r} is not one of {', '.join(KERNELS)}")
    fits = torch.device(device).type == "cpu" and onednn_available() and dtype in packable_dtypes()
    if requested == "onednn" and not fits:
        native = "" if bf16_native() else " (bf16 too only where the CPU computes it: avx512_bf16 or AMX)"
        raise LinearKernelError(
            f"option.linear_kernel=onednn runs fp32 or bf16 Linear layers on the CPU with oneDNN{native}; this model "
            f"is {dtype} on {device}{'' if onednn_available() else ' and torch has no oneDNN'}: use auto or torch")
    return "onednn" if requested == "auto" and fits else ("torch" if requested == "auto" else requested)


def attach_row_kernel(model: nn.Module, policy: str, available_bytes: int | None = None) -> RowKernelReport:
    """Give `model`'s fp32 OneDnnLinear layers their copy for the row kernel as `policy` (option.row_kernel)
    says (row_kernel.py)."""
    layers = [(name, module) for name, module in model.named_modules()
              if isinstance(module, OneDnnLinear) and module.dtype == torch.float32]
    return use_row_kernel(layers, policy, available_bytes)


def linear_report(model: nn.Module, requested: str, device: torch.device) -> LinearKernelReport:
    """The kernel option.linear_kernel gives `model` here (choose_kernel), as an empty report the steps fill."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return LinearKernelReport(choose_kernel(requested, device, dtype), "bf16" if dtype == torch.bfloat16 else "fp32")


def swap_norms(model: nn.Module, report: LinearKernelReport) -> None:
    """RMSNorm layers on F.rms_norm (or the norm kernel) where that gives their bits (fused_norms.py); either kernel."""
    report.norms = use_fused_norms(model)


def swap_lean_layers(model: nn.Module, report: LinearKernelReport, device: torch.device) -> None:
    """Llama-family decoder layers take their lean forward (lean_layers.py), on the CPU only: measured on CPUs
    so far, GPUs keep transformers' own."""
    if torch.device(device).type == "cpu":
        report.lean = use_lean_layers(model)


def stack_sibling_layers(model: nn.Module, report: LinearKernelReport) -> None:
    """Siblings of one input (q/k/v, gate/up) stacked into one packed matmul (shared_input.py); onednn only."""
    report.stacked = stack_shared_inputs(model, packable_dtypes(), OneDnnLinear)
    report.swapped.extend(report.stacked)


def swap_onednn(model: nn.Module, report: LinearKernelReport) -> None:
    """Every plain fp32 (or native bf16) nn.Linear left on the CPU becomes an OneDnnLinear; the others are
    kept, with why. The packed weights are copies: the loaded file and the plain weights are let go."""
    with torch.no_grad():
        for name, module in list(model.named_modules()):
            if not isinstance(module, nn.Linear):
                continue
            if type(module) is not nn.Linear:  # its own forward (Llama 4's router returns a tuple): keep it
                report.kept[name] = f"{type(module).__name__}, a subclass with its own forward"
                continue
            if module.weight.dtype not in packable_dtypes() or module.weight.device.type != "cpu":
                report.kept[name] = f"{module.weight.dtype} on {module.weight.device}"
                continue
            replace_module(model, name, OneDnnLinear(module))
            report.swapped.append(name)
    own_remaining_tensors(model)  # as kernels/layers/quantize.py does
    return_freed_memory()


def attach_row_copies(model: nn.Module, report: LinearKernelReport, policy: str) -> None:
    """One to the row kernel's rows of each fp32 OneDnnLinear on its copy, as option.row_kernel says (row_kernel.py)."""
    report.row_kernel = attach_row_kernel(model, policy)


def use_linear_kernel(model: nn.Module, requested: str, device: torch.device,
                      stack_siblings: bool = True, lean: bool = True, row_kernel: str = "auto") -> LinearKernelReport:
    """option.linear_kernel's steps in their order, as kernels/plan.py runs them: swap_norms, swap_lean_layers
    (unless `lean` is False: the benchmarks' baseline), then with oneDNN stack_sibling_layers (unless
    `stack_siblings` is False), swap_onednn and attach_row_copies (`row_kernel`: option.row_kernel).
    Raises LinearKernelError for a request that cannot apply."""
    report = linear_report(model, requested, device)
    swap_norms(model, report)
    if lean:
        swap_lean_layers(model, report, device)
    if report.kernel == "torch":
        return report
    started = time.monotonic()
    if stack_siblings:
        stack_sibling_layers(model, report)
    swap_onednn(model, report)
    attach_row_copies(model, report, row_kernel)
    report.seconds = time.monotonic() - started
    log.info("%s", report.describe())
    return report
