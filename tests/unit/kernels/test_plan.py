"""kernels/plan.py: `plan_kernels` runs the swaps in their order, once per model, and says what it did."""

from __future__ import annotations

import json

import torch

from lmi_serve.config.sources import ModelConfig
from lmi_serve.kernels.attention import KERNEL_FLAG
from lmi_serve.kernels.host import probe
from lmi_serve.kernels.layers.linear_kernels import OneDnnLinear
from lmi_serve.kernels.plan import plan_kernels
from lmi_serve.kernels.registry import KERNELS
from test_linear_kernels import tiny_llama

CPU = torch.device("cpu")
ORDER = ["quantize", "fused_norms", "lean_layers", "stack_siblings", "onednn_linear", "row_copies", "decode_attention"]


def _names(plan) -> list[str]:
    return [step.name for step in plan.steps]


def test_the_plan_runs_its_steps_in_order_and_reports_every_kernel():
    model = tiny_llama(tied=True)
    plan = plan_kernels(model, ModelConfig(name="m"), probe(), device=CPU)
    names = _names(plan)
    assert names == [name for name in ORDER if name in names]  # the order, whatever steps apply here
    assert names[-1] == "decode_attention" and "fused_norms" in names
    assert set(plan.uses) == set(KERNELS)
    if probe().onednn:
        assert any(isinstance(m, OneDnnLinear) for m in model.modules()) and plan.uses["onednn_linear"] == "used"
    json.dumps(plan.describe())  # GET /models/<m> shows it as it is
    assert plan.summary().startswith("Kernel plan: ")


def test_an_encoder_plan_skips_what_only_generation_uses():
    model = tiny_llama(tied=True)
    plan = plan_kernels(model, ModelConfig(name="m"), probe(), device=CPU, generates=False)
    assert {"quantize", "row_copies", "decode_attention"}.isdisjoint(_names(plan))
    assert plan.uses["row"] != "used" and plan.uses["decode_attention"] != "used"


def test_a_sharded_rank_keeps_torchs_linear_and_sdpa_is_chosen_by_option():
    model = tiny_llama(tied=True)
    plan = plan_kernels(model, ModelConfig(name="m", decode_attention="sdpa"), probe(), device=CPU, sharded=True)
    assert not any(isinstance(m, OneDnnLinear) for m in model.modules())
    assert getattr(model.config, KERNEL_FLAG) is False and plan.uses["decode_attention"] != "used"
