"""option.row_kernel (kernels/cpu/row_kernel.py): one to MAX_ROWS fp32 rows on a kernel of our own, oneDNN's batched bits.

- One to MAX_ROWS rows get bit for bit what each row gets alone, and what the same rows get in larger batches
  (to 300 rows) on oneDNN
  (with and without bias, input widths on both sides of oneDNN's change of block size, output widths that
  are not a multiple of the kernel's 32), for 2-D and 3-D inputs, and the row kernel is what computed them.
- Its results are F.linear's up to summation order.
- The policy: `off` gives no copy, `on` a copy to every fp32 oneDNN layer, `auto` only where the copies fit
  in a quarter of the memory available (else it says why); an unknown value is refused; a swapped model with
  copies keeps the logits and greedy rows of the model as loaded, alone or batched.
- A layer whose batched bits no block size reproduces keeps oneDNN.
- The option is validated at start-up and refused for embedding models.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from lmi_serve.config.models import options_not_taken
from lmi_serve.config.sources import ConfigError, ModelConfig
from lmi_serve.kernels.cpu import row_kernel
from lmi_serve.kernels.host import onednn_available
from lmi_serve.kernels.layers.linear_kernels import OneDnnLinear, attach_row_kernel, use_linear_kernel
from lmi_serve.kernels.cpu.row_kernel import MAX_ROWS, RowWeights, probe_block

from test_linear_kernels import IDS, close, greedy, logits, tiny_llama

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not onednn_available() or row_kernel.kernel() is None,
                                reason="this torch has no oneDNN, or numba's OpenMP layer is missing")


def with_row_weights(linear: torch.nn.Linear) -> OneDnnLinear:
    layer = OneDnnLinear(linear)
    weights = probe_block(linear.weight.detach(), linear.bias, layer.batched)
    assert weights is not None, "no block size gave oneDNN's batched bits"
    layer.use_row_kernel(weights)
    return layer


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_features,out_features", [(96, 160), (576, 960), (1280, 100), (1536, 576), (2048, 64)])
def test_a_row_alone_gets_the_bits_it_gets_in_any_batch(in_features, out_features, bias):
    torch.manual_seed(0)
    layer = with_row_weights(torch.nn.Linear(in_features, out_features, bias=bias))
    larger = [MAX_ROWS + 1, MAX_ROWS + 2, MAX_ROWS + 15, 2 * MAX_ROWS + 1, 300]  # oneDNN's, its kernels for many rows
    x = torch.randn(larger[-1], in_features)
    batched = layer._linear
    calls = []
    layer._linear = lambda rows: calls.append(rows.shape[0]) or batched(rows)
    with torch.no_grad():
        few = [layer(x[:rows]) for rows in range(1, MAX_ROWS + 1)]
        alone = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
        assert calls == []  # the row kernel computed them, not oneDNN
        assert [f.shape for f in few] == [(rows, out_features) for rows in range(1, MAX_ROWS + 1)]
        assert all(torch.equal(few[rows - 1], alone[:rows]) for rows in range(1, MAX_ROWS + 1))
        assert all(torch.equal(layer(x[:rows]), alone[:rows]) for rows in larger)
        assert calls == larger
        for rows in (1, MAX_ROWS):  # a decode step's shape
            assert torch.equal(layer(x[:rows].reshape(rows, 1, in_features)).reshape(rows, out_features), few[rows - 1])
        layer._linear = batched


@pytest.mark.parametrize("bias", [False, True])
def test_a_row_alone_computes_f_linear(bias):
    torch.manual_seed(1)
    linear = torch.nn.Linear(576, 200, bias=bias)
    layer = with_row_weights(copy.deepcopy(linear))
    x = torch.randn(1, 576)
    with torch.no_grad():
        assert close(layer(x), F.linear(x, linear.weight, linear.bias))


def test_a_layer_whose_bits_no_block_size_gives_keeps_onednn():
    torch.manual_seed(2)
    linear = torch.nn.Linear(576, 64, bias=False)
    # a batched kernel that sums in another order (pairs of columns first): no candidate reproduces it
    other_order = lambda rows: (rows[:, 0::2] @ linear.weight[:, 0::2].T) + (rows[:, 1::2] @ linear.weight[:, 1::2].T)
    assert probe_block(linear.weight.detach(), None, other_order) is None


def test_the_copy_is_laid_out_in_tiles_of_32_outputs_padded_with_zeros():
    weight = torch.arange(40 * 3, dtype=torch.float32).reshape(40, 3)
    packed = RowWeights.pack(weight, None, 512)
    assert packed.weights.shape == (2, 3, 32)
    assert torch.equal(packed.weights[1, :, :8], weight[32:].T) and not packed.weights[1, :, 8:].any()
    assert packed.nbytes == 2 * 3 * 32 * 4


def model_with_kernel(policy: str, available: int | None = None):
    model = tiny_llama(tied=True)
    reference = copy.deepcopy(model)
    use_linear_kernel(model, "onednn", CPU, row_kernel="off")
    return model, reference, attach_row_kernel(model, policy, available_bytes=available)


def row_kernel_layers(model) -> int:
    return sum(1 for m in model.modules() if isinstance(m, OneDnnLinear) and m._row_weights is not None)


def test_off_gives_no_copy_and_on_gives_every_fp32_onednn_layer_one():
    model, _, report = model_with_kernel("off")
    assert report.layers == 0 and row_kernel_layers(model) == 0 and "not used (off)" in report.describe()
    model, _, report = model_with_kernel("on", available=1)
    layers = sum(1 for m in model.modules() if isinstance(m, OneDnnLinear))
    assert report.layers == row_kernel_layers(model) == layers and not report.unmatched
    assert report.nbytes == sum(m._row_weights.nbytes for m in model.modules() if isinstance(m, OneDnnLinear))


def test_auto_copies_only_where_the_copies_fit_in_a_quarter_of_the_memory_available():
    model, _, report = model_with_kernel("auto", available=10**12)
    assert report.layers == row_kernel_layers(model) > 0
    need = report.nbytes
    model, _, report = model_with_kernel("auto", available=4 * need - 4)
    assert report.layers == row_kernel_layers(model) == 0
    assert "more than a quarter" in report.why_not and "`on` forces them" in report.why_not


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="option.row_kernel"):
        attach_row_kernel(tiny_llama(tied=False), "sometimes")


def test_a_model_with_one_row_copies_keeps_its_logits_and_greedy_rows(smollm2_tokenizer):
    model, reference, report = model_with_kernel("on")
    assert report.layers > 0
    assert close(logits(model, IDS), logits(reference, IDS))
    prompts = [*IDS, [11, 12, 13], list(range(400, 411))]
    together = greedy(model, smollm2_tokenizer, prompts)
    alone = [greedy(model, smollm2_tokenizer, [p])[0] for p in prompts]  # decode steps of one row: the row kernel
    assert together == alone
    assert together == greedy(reference, smollm2_tokenizer, prompts)


def test_the_option_is_validated_at_start_up_and_refused_for_embedding_models():
    assert ModelConfig(name="m").row_kernel == "auto"
    assert ModelConfig(name="m", row_kernel="OFF").row_kernel == "off"
    with pytest.raises((ConfigError, ValueError), match="row_kernel"):
        ModelConfig(name="m", row_kernel="sometimes")
    refused = dict(options_not_taken(ModelConfig(name="m", row_kernel="on"), "text-embedding"))
    assert "text generation only" in refused["row_kernel"]
    assert options_not_taken(ModelConfig(name="m"), "text-embedding") == []
