"""RMSNorm layers on torch's own kernel (`F.rms_norm`) where it gives the layer's bits (model surgery, no engine).

The RMSNorm of the Llama family in transformers is six eager ops (upcast, pow, mean, add, rsqrt, two
muls); `F.rms_norm` runs the same arithmetic in one call: 22 against 35 µs for one 576-wide row on a
2-core Xeon, 31 against 44 µs for 32 rows. A SmolLM2 decode step has 61 of them.

A bf16 (or fp16) layer of that family normalises in fp32 and rounds before it multiplies by its weight, so
`F.rms_norm` with the weight (one rounding) is not its bits; the same layer as `F.rms_norm` of the fp32 upcast
without the weight, rounded, times the weight is (four calls instead of eight: 11.9 against 14.6 µs a row).

A layer is swapped only where both answer the same bits: its class's forward and each form (the direct
one first, then the upcast one) are compared once per (class, width, dtype, device) on random rows. Any
other formula (Gemma's `1 + weight`, a norm that casts elsewhere) fails both and keeps its own forward.

A few rows (a decode step's) go further, to kernels/cpu/norm_kernel.py: the same arithmetic in one numba call
(~2 against 7.5-11 µs a 576-wide row), used only where the same probe finds its bits the layer's too.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from lmi_serve.kernels.cpu import norm_kernel
from lmi_serve.kernels.layers.surgery import replace_module

log = logging.getLogger(__name__)

FORMS = ("direct", "upcast")
# (class, width, dtype, device) -> (the form that answers its bits, whether norm_kernel.py does too), or None
_AGREES: dict[tuple, tuple[str, bool] | None] = {}


class FusedRMSNorm(nn.Module):
    """An RMSNorm computed by `F.rms_norm`, holding the replaced layer's own weight: `direct` (the weight
    inside the call) or `upcast` (normalised in fp32, rounded to the input's dtype, then times the weight)."""

    def __init__(self, norm: nn.Module, eps: float, form: str = "direct", kernel: bool = False):
        super().__init__()
        if form not in FORMS:
            raise ValueError(f"unknown RMSNorm form {form!r}; known: {', '.join(FORMS)}")
        self.weight = norm.weight
        self.variance_epsilon = eps  # the name transformers' RMSNorms use, for code that reads it
        self.form = form
        self._shape = (norm.weight.shape[0],)
        self._own = (norm,)  # a tuple: not a submodule, so its weight is not registered twice
        # norm_kernel.py for a few rows: only where the probe found its bits the layer's
        weight = norm.weight
        self.kernel = (kernel and weight.device.type == "cpu" and weight.is_contiguous()
                       and norm_kernel.FORMS[form] == weight.dtype and norm_kernel.kernel() is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self._parameters.get("weight")  # a dict read, not nn.Module.__getattr__: 61 calls a step
        if weight is None:  # the replaced norm held a plain tensor, not a Parameter: an attribute here too
            weight = self.weight
        if x.dtype != weight.dtype:  # probed for the weight's dtype only: the layer's own casts decide
            return self._own[0](x)
        if (self.kernel and x.is_cpu and x.numel() <= norm_kernel.MAX_ELEMENTS and x.shape[-1] == self._shape[0]
                and x.is_contiguous()):
            return norm_kernel.rms_norm(x, weight, self.variance_epsilon, self.form)
        if self.form == "upcast":
            return F.rms_norm(x.float(), self._shape, None, self.variance_epsilon).to(x.dtype) * weight
        return F.rms_norm(x, self._shape, weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        kernel = "F.rms_norm" + (", norm_kernel.py for few rows" if self.kernel else "")
        return f"{self._shape[0]}, eps={self.variance_epsilon}, kernel={kernel} ({self.form})"


def _eps(norm: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(norm, name, None)
        if isinstance(value, float):
            return value
    return None


def _agreeing_form(norm: nn.Module, eps: float) -> tuple[str, bool] | None:
    """The first of FORMS whose `F.rms_norm` answers `norm`'s bits on random rows (a batch, one row, a
    4-D input) and whether norm_kernel.py does too, or None."""
    weight = norm.weight
    key = (type(norm), weight.shape[0], weight.dtype, weight.device)
    if key not in _AGREES:
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            inputs = [torch.randn(shape, generator=generator).mul(3).to(weight.dtype).to(weight.device)
                      for shape in ((5, 7, weight.shape[0]), (1, 1, weight.shape[0]), (2, 3, 4, weight.shape[0]))]
            expected = [norm(x) for x in inputs]
            form = next((form for form in FORMS if all(torch.equal(want, FusedRMSNorm(norm, eps, form)(x))
                                                       for x, want in zip(inputs, expected))), None)
            kernel = form is not None and FusedRMSNorm(norm, eps, form, kernel=True).kernel and all(
                torch.equal(want, FusedRMSNorm(norm, eps, form, kernel=True)(x))
                for x, want in zip(inputs, expected))
            _AGREES[key] = (form, kernel) if form is not None else None
    return _AGREES[key]


def use_fused_norms(model: nn.Module) -> list[str]:
    """Swap every RMSNorm layer of `model` that `F.rms_norm` answers bit for bit for a FusedRMSNorm, in
    place; returns the swapped layers' names (logged)."""
    swapped, kept = [], set()
    for name, module in list(model.named_modules()):
        weight, eps = getattr(module, "weight", None), _eps(module)
        if not type(module).__name__.endswith("RMSNorm") or not isinstance(weight, torch.Tensor) or eps is None:
            continue
        if weight.dim() != 1 or weight.device.type == "meta":
            continue
        agreed = _agreeing_form(module, eps)
        if agreed is not None:
            replace_module(model, name, FusedRMSNorm(module, eps, *agreed))
            swapped.append(name)
        else:
            kept.add(type(module).__name__)
    if swapped or kept:
        log.info("RMSNorm on F.rms_norm: %d layers%s", len(swapped),
                 f"; kept their own forward (other bits): {', '.join(sorted(kept))}" if kept else "")
    return swapped
