"""kernels/footprint.py: a planned model's weights counted in the forms it holds them, each tensor once, and the
row kernel's copies apart (GET /models/<m>'s `memory`, the multi-model budget)."""

from __future__ import annotations

import pytest
import torch

from lmi_serve.config.sources import ModelConfig
from lmi_serve.kernels.footprint import weight_footprint
from lmi_serve.kernels.host import probe
from lmi_serve.kernels.plan import plan_kernels
from test_linear_kernels import tiny_llama

CPU = torch.device("cpu")


def _loaded_bytes(model) -> int:
    """Parameters and buffers as loaded; parameters() yields a tied weight once."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def _linear_bytes(model) -> int:
    return sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_a_model_as_loaded_counts_each_tensor_once_tied_embeddings_included():
    model = tiny_llama(tied=True)
    assert weight_footprint(model).weights == _loaded_bytes(model)
    assert weight_footprint(model).row_copies == 0


@pytest.mark.parametrize("tied", [True, False])
def test_the_plans_packed_weights_replace_the_loaded_ones_and_row_copies_count_apart(tied):
    model = tiny_llama(tied)
    loaded, linears = _loaded_bytes(model), _linear_bytes(model)
    vocab_by_hidden = model.config.vocab_size * model.config.hidden_size * 4
    plan = plan_kernels(model, ModelConfig(name="m", row_kernel="on"), probe(), device=CPU)
    memory = plan.memory
    if plan.linear.kernel != "onednn":  # a host without oneDNN's packing: the model keeps its weights
        assert memory.weights == loaded and memory.row_copies == 0
        return
    # packed q/k/v and gate/up stacks hold what the separate layers held; a tied lm_head gets its own packed copy
    assert memory.weights == loaded + (vocab_by_hidden if tied else 0)
    if plan.linear.row_kernel.layers:
        assert memory.row_copies == plan.linear.row_kernel.nbytes >= linears
    assert plan.memory.total == memory.weights + memory.row_copies


def test_without_the_row_kernel_there_are_no_copies():
    model = tiny_llama(tied=False)
    plan = plan_kernels(model, ModelConfig(name="m", row_kernel="off"), probe(), device=CPU)
    assert plan.memory.row_copies == 0
