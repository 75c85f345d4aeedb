"""option.linear_kernel (kernels/layers/linear_kernels.py): fp32 Linear layers on oneDNN's packed weights.

- A swapped layer computes F.linear's result in fp32, up to the order of summation (2-D and 3-D
  inputs, with and without bias), and holds no plain weight.
- A swapped model gives the logits of the model as loaded, to fp32 rounding; a tied lm_head gets its
  own packed copy while the input embedding keeps its fp32 weight; greedy rows do not depend on what
  else is in the batch.
- `auto` picks oneDNN only where it applies (fp32 on the CPU, and bf16 where the CPU computes it in
  hardware); `onednn` elsewhere, or an unknown value, is refused naming option.linear_kernel.
- bf16 (option.dtype=bf16, where the CPU has avx512_bf16 or AMX): a swapped layer keeps bf16 in and out and
  computes the bf16 product to bf16 rounding; a bf16 model is swapped whole and its logits stay those of
  the model as loaded within bf16's precision.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from lmi_serve.config.sources import ConfigError, ModelConfig
from lmi_serve.engine.static_batch import generate_static_batch
from lmi_serve.engine.types import GenerationRequest, StopParams
from lmi_serve.kernels.host import bf16_native, onednn_available
from lmi_serve.kernels.layers.linear_kernels import LinearKernelError, OneDnnLinear, choose_kernel, on_onednn, use_linear_kernel

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch was built without oneDNN")


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to fp32 summation order: within 1e-5 of the larger's scale."""
    a, b = a.detach(), b.detach()
    return a.dtype == b.dtype == torch.float32 and float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 96), (7, 96), (3, 5, 96)])
def test_a_swapped_layer_computes_f_linear_in_fp32(bias, shape):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160, bias=bias)
    x = torch.randn(*shape)
    swapped = OneDnnLinear(linear)
    out = swapped(x)
    assert out.shape == (*shape[:-1], 160)
    assert close(out, F.linear(x, linear.weight, linear.bias))
    assert swapped.weight is None and "kernel=onednn" in repr(swapped)


def tiny_llama(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=tied, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, 0.2)  # larger than the init, so greedy output depends on the prompt
    return model


IDS = [[5, 17, 99, 3, 250, 40, 7, 300], [9, 8, 7, 6, 5, 4, 3, 2]]


def logits(model, ids) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor(ids)).logits


@pytest.mark.parametrize("tied", [True, False])
def test_a_swapped_model_gives_the_logits_of_the_model_as_loaded(tied):
    model = tiny_llama(tied)
    reference = copy.deepcopy(model)
    embedding = model.get_input_embeddings().weight.detach().clone()
    report = use_linear_kernel(model, "auto", CPU)
    assert report.kernel == "onednn" and not report.kept
    assert len(report.swapped) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and lm_head
    assert all(on_onednn(model.get_submodule(name)) for name in report.swapped)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert torch.equal(model.get_input_embeddings().weight, embedding)  # a tied embedding keeps its own weight
    assert close(logits(model, IDS), logits(reference, IDS))


def greedy(model, tokenizer, prompts) -> list[list[int]]:
    requests = [GenerationRequest(tuple(p), stop=StopParams(max_new_tokens=12, ignore_eos=True)) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    for owner, event in generate_static_batch(model, tokenizer, CPU, requests):
        out[owner].append(event.token_id)
    return out


def test_greedy_rows_do_not_depend_on_the_batch_with_onednn_layers(smollm2_tokenizer):
    model = tiny_llama(tied=True)
    use_linear_kernel(model, "onednn", CPU)
    prompts = [*IDS, [11, 12, 13], list(range(400, 411))]
    together = greedy(model, smollm2_tokenizer, prompts)
    alone = [greedy(model, smollm2_tokenizer, [p])[0] for p in prompts]
    assert together == alone
    assert len({tuple(t) for t in together}) == len(prompts)  # premise: the outputs depend on the prompt


@pytest.mark.parametrize("in_features", [576, 1280, 1536, 2048, 8192])
def test_a_row_alone_gets_the_bits_it_gets_in_any_batch(in_features):
    # oneDNN answers one fp32 row with another kernel from 1,280 input features up; its last bits differed
    # from the same row's in a batch (the MLP's down projection of SmolLM2, every projection of Llama 1B).
    torch.manual_seed(0)
    layer = OneDnnLinear(torch.nn.Linear(in_features, 96))
    x = torch.randn(33, in_features)
    with torch.no_grad():
        alone = layer(x[:1])
        assert all(torch.equal(layer(x[:rows])[:1], alone) for rows in range(2, 34))
        assert torch.equal(layer(x[:1].reshape(1, 1, in_features)).reshape(1, 96), alone)  # a decode step's shape


@pytest.mark.parametrize("in_features", [576, 1536])
def test_a_row_alone_is_computed_as_two_only_where_the_kernel_differs(in_features):
    # The second row is a copy and a cost (~4 ms of a 50 ms SmolLM2 step): paid only for shapes whose
    # one-row answer differs from the row's answer in a pair, which the layer probes once.
    torch.manual_seed(0)
    layer = OneDnnLinear(torch.nn.Linear(in_features, 96))
    x = torch.randn(2, in_features)
    with torch.no_grad():
        differs = not torch.equal(layer._linear(x[:1]), layer._linear(x)[:1])
        seen = []
        kernel = layer._linear
        layer._linear = lambda rows: seen.append(rows.shape[0]) or kernel(rows)
        layer(x[:1])
    assert layer._row_alone_differs == differs
    assert seen == ([2] if differs else [1])


def test_torch_leaves_the_model_as_it_is():
    model = tiny_llama(tied=False)
    report = use_linear_kernel(model, "torch", CPU)
    assert report.kernel == "torch" and not report.swapped
    assert sum(isinstance(m, torch.nn.Linear) for m in model.modules()) == 15


def test_auto_picks_onednn_only_for_fp32_on_the_cpu_and_bf16_where_it_is_native():
    assert choose_kernel("auto", CPU, torch.float32) == "onednn"
    assert choose_kernel("auto", CPU, torch.bfloat16) == ("onednn" if bf16_native() else "torch")
    assert choose_kernel("auto", CPU, torch.float16) == "torch"
    assert choose_kernel("auto", torch.device("cuda"), torch.float32) == "torch"
    assert choose_kernel("torch", CPU, torch.float32) == "torch"


@pytest.mark.parametrize("device,dtype", [(CPU, torch.float16), (torch.device("cuda"), torch.float32)])
def test_onednn_where_it_cannot_run_is_refused_by_name(device, dtype):
    with pytest.raises(LinearKernelError, match="option.linear_kernel=onednn"):
        choose_kernel("onednn", device, dtype)


def test_the_option_is_validated_at_start_up():
    assert ModelConfig(name="m").linear_kernel == "auto"
    assert ModelConfig(name="m", linear_kernel="OneDNN").linear_kernel == "onednn"
    with pytest.raises((ConfigError, ValueError), match="linear_kernel"):
        ModelConfig(name="m", linear_kernel="mkl")
    with pytest.raises(LinearKernelError, match="'mkl' is not one of auto, onednn, torch"):
        choose_kernel("mkl", CPU, torch.float32)


needs_bf16 = pytest.mark.skipif(not bf16_native(), reason="this CPU has neither avx512_bf16 nor AMX: bf16 stays on torch")


@needs_bf16
@pytest.mark.parametrize("shape", [(1, 96), (7, 96), (3, 5, 96)])
def test_a_bf16_layer_stays_bf16_and_computes_the_bf16_product(shape):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160, bias=True).to(torch.bfloat16)
    x = torch.randn(*shape).to(torch.bfloat16)
    out = OneDnnLinear(linear)(x).detach()
    assert out.dtype == torch.bfloat16 and out.shape == (*shape[:-1], 160)
    exact = F.linear(x.float(), linear.weight.detach().float(), linear.bias.detach().float())  # the same bf16 inputs, fp32 sums
    # bf16 keeps 8 bits of mantissa: the result may differ from the exact product by its own rounding, a few ulps
    assert float((out.float() - exact).abs().max()) <= 2 ** -6 * float(exact.abs().max())
    assert "bfloat16" in repr(OneDnnLinear(linear))


@needs_bf16
def test_a_bf16_model_is_swapped_whole_and_keeps_its_logits_within_bf16():
    model = tiny_llama(tied=True).to(torch.bfloat16)
    reference = copy.deepcopy(model)
    report = use_linear_kernel(model, "auto", CPU)
    assert (report.kernel, report.dtype, len(report.swapped), report.kept) == ("onednn", "bf16", 15, {})
    assert "15 bf16 Linear layers" in report.describe()
    got, want = logits(model, IDS), logits(reference, IDS)
    assert got.dtype == torch.bfloat16
    assert float((got.float() - want.float()).abs().max()) <= 2 ** -5 * float(want.float().abs().max())
    assert torch.equal(got.argmax(-1), want.argmax(-1))
