"""The one call that decides what runs a loaded model's forward on this host, and says what it decided.

`plan_kernels(model, config, host, device=...)` applies the swaps in their order and returns a `KernelPlan`:

    1. quantize          option.quantize: fp16 or a checkpoint's Q4/Q8 blocks replace Linear layers (layers/quantize.py)
    2. fused_norms       RMSNorm on F.rms_norm or the norm kernel, the same bits (layers/fused_norms.py)
    3. lean_layers       Llama-family decoder layers in fewer ops, on a CPU (layers/lean_layers.py)
    4. stack_siblings    q/k/v and gate/up stacked into one matmul (layers/shared_input.py)       } with
    5. onednn_linear     the remaining Linear layers on oneDNN's packed weights                    } option.linear_kernel
    6. row_copies        one to 64 fp32 rows on the row kernel's copies (cpu/row_kernel.py)       } = onednn
    7. decode_attention  a decode step's attention in cpu/decode_kernel.py or SDPA (attention.py)

Each step needs the one before (quantized layers are not nn.Linear, so oneDNN leaves them; stacking runs on
plain Linear layers; row copies are made of the packed layers). The text handler, the embedding and
classifier handlers (no quantize, no row copies, no decode attention: an encoder's batches are whole
inputs) and the tensor-parallel follower (a sharded layer keeps torch's kernel: its forward carries the
communication) call it; the handler logs the plan once, and GET /models/<m> shows `describe()`.

`python -m lmi_serve.serving.kernel_plan` prints the plan for the default model on this host.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from torch import nn

from lmi_serve.kernels.attention import use_decode_kernel
from lmi_serve.kernels.footprint import WeightFootprint, weight_footprint
from lmi_serve.kernels.host import Host
from lmi_serve.kernels.layers import linear_kernels as linear
from lmi_serve.kernels.layers.fused_norms import FusedRMSNorm
from lmi_serve.kernels.layers.block_linears import BlockLinear
from lmi_serve.kernels.layers.gguf_linears import Q4Linear, Q8Linear
from lmi_serve.kernels.layers.quantize import QuantizeReport, quantize_model
from lmi_serve.kernels.registry import KERNELS

log = logging.getLogger(__name__)


@dataclass
class Step:
    """One step the plan ran: its name (the module docstring's), what it did, and how long it took."""

    name: str
    did: str
    seconds: float = 0.0


@dataclass
class KernelPlan:
    """What runs this model's forward here: the host, the steps in the order they ran, and per registry kernel
    whether the model uses it (`uses`: kernel name -> "used", or why not)."""

    host: Host
    steps: list[Step] = field(default_factory=list)
    uses: dict[str, str] = field(default_factory=dict)
    quantized: QuantizeReport | None = None
    linear: linear.LinearKernelReport | None = None
    memory: WeightFootprint | None = None  # the weights' bytes in the forms the plan left (footprint.py)

    def describe(self) -> dict[str, Any]:
        """The plan as JSON (GET /models/<m>, the engine section's `kernels`)."""
        return {"host": self.host.describe(), "steps": [{"name": s.name, "did": s.did} for s in self.steps],
                "kernels": self.uses}

    def summary(self) -> str:
        """The plan in one log line."""
        used = ", ".join(name for name, use in self.uses.items() if use == "used") or "none"
        steps = "; ".join(f"{s.name}: {s.did}" for s in self.steps)
        return f"Kernel plan: {steps}. Kernels used: {used}"


def plan_kernels(model: nn.Module, config: Any, host: Host, *, device: Any, generates: bool = True,
                 q4_source: Path | None = None, sharded: bool = False) -> KernelPlan:
    """Apply the swaps to `model` in their order (module docstring) as `config` (a ModelConfig) asks, on
    `device`; `generates`: a text-generation model (else an encoder: steps 1, 6 and 7 are skipped); `q4_source`:
    the GGUF or Q4Blocks file whose 4-bit weights option.quantize=q4 reads (model/loader.py four_bit_source); `sharded`: a tensor-parallel rank (torch's Linear kept). Raises
    QuantizeError or LinearKernelError naming the option that cannot apply."""
    plan = KernelPlan(host)
    quantize = getattr(config, "quantize", "none") if generates else "none"
    if quantize != "none":
        lm_head_int8 = getattr(config, "quantize_lm_head", False)
        plan.quantized = _step(plan, "quantize", lambda: quantize_model(model, quantize, device, q4_source,
                                                                      lm_head_int8=lm_head_int8),
                               lambda report: report.describe())
    requested = "torch" if sharded else config.linear_kernel
    report = plan.linear = linear.linear_report(model, requested, device)
    _step(plan, "fused_norms", lambda: linear.swap_norms(model, report), lambda _: f"{len(report.norms)} RMSNorm layers")
    _step(plan, "lean_layers", lambda: linear.swap_lean_layers(model, report, device),
          lambda _: f"{len(report.lean)} decoder layers")
    if report.kernel == "onednn":
        _step(plan, "stack_siblings", lambda: linear.stack_sibling_layers(model, report),
              lambda _: f"{len(report.stacked)} layers stacked with siblings")
        _step(plan, "onednn_linear", lambda: linear.swap_onednn(model, report),
              lambda _: f"{len(report.swapped)} {report.dtype} Linear layers; kept: {', '.join(report.kept) or 'none'}")
        if generates:  # an encoder's batches are whole inputs, never a few rows: no copies
            _step(plan, "row_copies", lambda: linear.attach_row_copies(model, report, config.row_kernel),
                  lambda _: report.row_kernel.describe())
    else:
        plan.steps.append(Step("onednn_linear", f"off: option.linear_kernel gives {report.kernel} here"))
    if generates:
        on = config.decode_attention == "auto"
        why_not = "the kernel does not apply here" if on else "option.decode_attention=sdpa"
        _step(plan, "decode_attention", lambda: use_decode_kernel(model, on),
              lambda kernel: "the decode kernel" if kernel else f"SDPA ({why_not})")
    plan.uses = kernel_uses(model, plan, config, generates)
    row_copies = report.row_kernel.nbytes if report.row_kernel is not None else 0
    plan.memory = weight_footprint(model, row_copies)
    return plan


def _step(plan: KernelPlan, name: str, run: Callable[[], Any], did: Callable[[Any], str]) -> Any:
    started = time.monotonic()
    result = run()
    plan.steps.append(Step(name, did(result), time.monotonic() - started))
    return result


def kernel_uses(model: nn.Module, plan: KernelPlan, config: Any, generates: bool) -> dict[str, str]:
    """Per registry kernel: "used" where the swapped model calls it, else why not (the host lacks what it
    needs, or no step put a layer on it)."""
    modules = list(model.modules())
    found = {
        "onednn_linear": any(isinstance(m, linear.OneDnnLinear) for m in modules),
        "row": any(isinstance(m, linear.OneDnnLinear) and m._row_weights is not None for m in modules),
        "norm": any(isinstance(m, FusedRMSNorm) and m.kernel for m in modules),
        "q4": any(isinstance(m, Q4Linear) and m.kernel_weights is not None for m in modules),
        "block_bf16": any(isinstance(m, BlockLinear) for m in modules),
        "q8_vnni": any(isinstance(m, Q8Linear) for m in modules),
        "decode_attention": any(s.name == "decode_attention" and s.did == "the decode kernel" for s in plan.steps),
        "column_copy": generates and getattr(config, "kv_cache", None) == "slots",
    }
    lean = bool(plan.linear and plan.linear.lean)
    found["rotary"] = lean
    found["layer_chain"] = lean and found["row"] and found["norm"]
    found["q4_chain"] = lean and (found["q4"] or found["block_bf16"]) and found["norm"]
    uses = {}
    for name, kernel in KERNELS.items():
        missing = kernel.missing(plan.host)
        if missing:
            uses[name] = f"unavailable: the host lacks {', '.join(missing)}"
        elif not found.get(name):
            uses[name] = "not used by this model"
        elif kernel.module.startswith("cpu.") and kernel.load().kernel() is None:
            uses[name] = "did not compile (logged)"
        else:
            uses[name] = "used"
    return uses

