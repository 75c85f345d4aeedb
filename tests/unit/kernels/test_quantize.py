"""option.quantize (kernels/layers/quantize.py): the swapped model computes what its rounded weights say.

- fp16: logits equal fp32 matmuls with fp16-rounded weights; a tied lm_head gets its own fp16
  copy while the input embedding keeps its fp32 weight.
- q4: a tiny Llama whose Linear weights are the dequantized Q4_1 blocks of a GGUF written here (what
  the server's safetensors cache holds for a GGUF model) computes the same logits once its Linear
  layers run on those 4-bit blocks; weights that are not that GGUF's are refused. Loaded in bf16, its
  layers compute in bf16 (the kernel's fast path) about as close to fp32 as the bf16 model, and more
  than a few rows go to a bf16 oneDNN copy of the loaded weights; q/k/v and gate/up become slices of
  one stacked int4 layer that equal the separate layers bit for bit.
- Refusals name option.quantize; greedy output does not depend on what else is in the batch.
"""

from __future__ import annotations

import copy

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lmi_serve.config.sources import ConfigError, ModelConfig
from lmi_serve.kernels.host import cpu_has
from lmi_serve.kernels.registry import KERNELS
from lmi_serve.engine.static_batch import generate_static_batch
from lmi_serve.engine.types import GenerationRequest, StopParams
from lmi_serve.kernels.layers.linear_kernels import OneDnnLinear, packable_dtypes
from lmi_serve.kernels.host import omp_layer_loads
from lmi_serve.kernels.cpu import block_matmul, q4_kernel, vnni_matmul
from lmi_serve.kernels.layers.block_linears import BlockLinear
from lmi_serve.kernels.layers.gguf_linears import (Q4_MAX_ROWS, Q8_MAX_ROWS, Q4Blocks, Q4Linear, Q8Blocks, Q8Linear,
                                                   unpack_q4_blocks, unpack_q8_blocks)
from lmi_serve.kernels.layers.fp16_linear import Fp16Linear
from lmi_serve.kernels.layers.quantize import QuantizeError, quantize_model
from lmi_serve.kernels.layers.shared_input import SharedInputSlice

CPU = torch.device("cpu")
VOCAB = 512
HEADS, KV_HEADS = 4, 2


def tiny_llama(tied: bool, seed: int = 0, hidden: int = 64, intermediate: int = 128) -> LlamaForCausalLM:
    """2 layers, every Linear a multiple of 32 wide; weights redrawn so greedy output depends on the prompt."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                         tie_word_embeddings=tied, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, 0.2)
    return model


def logits(model, ids: list[list[int]]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor(ids)).logits


IDS = [[5, 17, 99, 3, 250, 40, 7, 300], [9, 8, 7, 6, 5, 4, 3, 2]]


def fp16_rounded_copy(model):
    """The reference: a copy whose every Linear has its own fp16-rounded weight (a tied input
    embedding keeps its fp32 one, as the fp16 swap does)."""
    reference = copy.deepcopy(model)
    for module in reference.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight = torch.nn.Parameter(module.weight.detach().half().float(), requires_grad=False)
    return reference


def test_fp16_equals_fp32_with_fp16_rounded_weights_and_keeps_the_tied_embedding_fp32():
    model = tiny_llama(tied=True)
    embedding = model.get_input_embeddings().weight.detach().clone()
    reference = fp16_rounded_copy(model)
    report = quantize_model(model, "fp16", CPU)
    assert isinstance(model.lm_head, Fp16Linear) and len(report.swapped) == 2 * 7 + 1 and not report.kept
    assert model.get_input_embeddings().weight.dtype == torch.float32
    assert torch.equal(model.get_input_embeddings().weight, embedding)
    got, want = logits(model, IDS), logits(reference, IDS)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    assert not torch.allclose(logits(tiny_llama(tied=True), IDS), want, atol=1e-4, rtol=1e-4), \
        "premise: fp16 rounding must change the logits, else this test proves nothing"
    assert report.weight_bytes_after * 2 == report.weight_bytes_before


def _permute_like_llama_cpp(w: np.ndarray, heads: int) -> np.ndarray:
    """The rotary row order llama.cpp's converter writes attn_q / attn_k in (the inverse of the loader's)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_q4_gguf(model: LlamaForCausalLM, path, qtype=gguf.GGMLQuantizationType.Q4_1, skip=(),
                  embedding: bool = False, embedding_type=gguf.GGMLQuantizationType.F32,
                  types: dict | None = None) -> None:
    """`model`'s Linear weights (but `skip`) as a Llama GGUF of 4-bit blocks (q / k rows permuted as
    llama.cpp does), then the model's weights replaced by those blocks dequantized, as the GGUF ->
    safetensors cache holds them; with `embedding`, the input embedding too, in `embedding_type`.
    `types`: another block type for some Linear modules (by module name)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, model.config.num_hidden_layers)
    if embedding:
        table = model.get_input_embeddings().weight
        if embedding_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor("token_embd.weight", table.detach().numpy())
        else:
            blocks = gguf.quants.quantize(table.detach().numpy(), embedding_type)
            writer.add_tensor("token_embd.weight", blocks, raw_dtype=embedding_type)
            with torch.no_grad():
                table.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, embedding_type)))
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear) or name in skip:
                continue
            gguf_name = names.get_name(name)
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(gguf_name.rsplit(".", 1)[-1])
            weight = module.weight.detach().numpy()
            stored = _permute_like_llama_cpp(weight, heads) if heads else weight
            its_type = (types or {}).get(name, qtype)
            blocks = gguf_blocks(stored, its_type)
            writer.add_tensor(f"{gguf_name}.weight", blocks, raw_dtype=its_type)
            loaded = gguf.quants.dequantize(blocks, its_type)
            if heads:  # undo the permutation as transformers' loader does
                half = loaded.shape[0] // heads // 2
                loaded = loaded.reshape(heads, half, 2, -1).swapaxes(2, 1).reshape(loaded.shape)
            module.weight.copy_(torch.from_numpy(np.ascontiguousarray(loaded)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """A simple Q4_K quantizer of our own (gguf has none): per 32-weight sub-block, scale (max - min) / 15 and
    min -min(0, min) as 6-bit multiples of the super-block's fp16 d and dmin; bytes laid out as ggml's."""
    rows = weight.shape[0]
    x = weight.reshape(rows, -1, 8, 32).astype(np.float32)
    low = np.minimum(x.min(-1), 0)
    wanted_scale, wanted_min = (x.max(-1) - low) / 15, -low
    d = (wanted_scale.max(-1) / 63).astype(np.float16)
    dmin = (wanted_min.max(-1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.round(wanted_scale / np.where(d32 > 0, d32, 1)), 1, 63).astype(np.uint8)
    m = np.clip(np.round(wanted_min / np.where(dmin32 > 0, dmin32, 1)), 0, 63).astype(np.uint8)
    scale, minimum = (d32 * sc)[..., None], (dmin32 * m)[..., None]
    q = np.clip(np.round((x + minimum) / np.where(scale > 0, scale, 1)), 0, 15).astype(np.uint8)
    packed = np.concatenate([(sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
                             (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)], axis=-1)
    nibbles = q[..., 0::2, :] | (q[..., 1::2, :] << 4)  # [rows, super-blocks, 4, 32]
    head = np.stack([d, dmin], axis=-1).view(np.uint8)  # [rows, super-blocks, 4]
    return np.concatenate([head, packed, nibbles.reshape(*nibbles.shape[:2], -1)], axis=-1).reshape(rows, -1)


def random_q6_k(weight: np.ndarray, seed: int = 0) -> np.ndarray:
    """Random Q6_K bytes of `weight`'s shape (210 bytes per 256 weights, its fp16 d last, set small)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (weight.shape[0], weight.shape[1] // 256, 210), dtype=np.uint8)
    raw[..., 208:] = np.full(raw.shape[:2], 3e-5, np.float16)[..., None].view(np.uint8)
    return raw.reshape(weight.shape[0], -1)


def gguf_blocks(weight: np.ndarray, qtype) -> np.ndarray:
    if qtype == gguf.GGMLQuantizationType.Q4_K:
        return quantize_q4_k(weight)
    if qtype == gguf.GGMLQuantizationType.Q6_K:
        return random_q6_k(weight)
    return gguf.quants.quantize(weight, qtype)


def test_quantize_q4_k_helper_is_a_quantizer():
    weight = np.random.default_rng(1).normal(0, 0.2, (32, 512)).astype(np.float32)
    back = gguf.quants.dequantize(quantize_q4_k(weight), gguf.GGMLQuantizationType.Q4_K)
    assert np.abs(back - weight).max() < 0.1 * np.abs(weight).max(), "premise: the test's Q4_K weights are the model's"


def test_unpacked_q4_k_blocks_are_what_gguf_dequantizes_from_random_bytes():
    rng = np.random.default_rng(0)
    rows, supers = 16, 3
    raw = rng.integers(0, 256, (rows, supers, 144), dtype=np.uint8)
    heads = rng.integers(0, 2**16, (rows, supers, 2), dtype=np.uint16)
    finite = np.isfinite(heads.view(np.float16))
    raw[..., :4] = np.where(finite, heads, 0x3C00).view(np.uint8).reshape(rows, supers, 4)  # non-finite -> 1.0
    raw = raw.reshape(rows, -1)
    blocks = unpack_q4_blocks(raw, "Q4_K")
    assert blocks.q.shape == (rows, supers * 256) and blocks.scale.shape == (rows, supers * 8)
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
    mine = blocks.dequantize().numpy()
    # float32 rounding of d sc q - dmin m: a couple of ulps of its larger term
    magnitude = np.repeat(16 * np.abs(blocks.scale) + np.abs(blocks.zero), 32, axis=1)
    assert (np.abs(mine - theirs) <= 2**-22 * magnitude).all(), np.abs(mine - theirs).max()
    assert np.abs(theirs).max() > 1e3 and (np.abs(theirs) < 1e-3).any(), "premise: fp16 d / dmin over their range"


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q4_0])
def test_q4_computes_the_dequantized_gguf_blocks(tmp_path, qtype):
    model = tiny_llama(tied=False)
    write_q4_gguf(model, tmp_path / "tiny.gguf", qtype)
    want = logits(model, IDS)  # fp32 on the dequantized blocks: the reference
    report = quantize_model(model, "q4", CPU, tmp_path / "tiny.gguf")
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.o_proj, Q4Linear) and isinstance(model.lm_head, Q4Linear)
    assert isinstance(layer.self_attn.q_proj, SharedInputSlice) and isinstance(layer.self_attn.q_proj.stacked, Q4Linear)
    assert isinstance(layer.mlp.up_proj, SharedInputSlice)
    assert len(report.swapped) == 2 * 7 + 1 and len(report.stacked) == 2 * 5 and not report.kept
    assert report.max_abs_diff < 1e-6
    got = logits(model, IDS)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


# a Q4_K_M file's mix: Q4_K for most Linear layers, Q6_K for some (here one down_proj), which keep their loaded weights
Q4_K_M_LIKE = {"qtype": gguf.GGMLQuantizationType.Q4_K,
               "types": {"model.layers.1.mlp.down_proj": gguf.GGMLQuantizationType.Q6_K}}


def tiny_llama_256(tied: bool = False) -> LlamaForCausalLM:
    """tiny_llama with every Linear's input a multiple of Q4_K's 256 weights."""
    return tiny_llama(tied, hidden=256, intermediate=256)


def test_q4_computes_the_dequantized_q4_k_blocks_and_keeps_a_q6_k_layer(tmp_path):
    model = tiny_llama_256()
    write_q4_gguf(model, tmp_path / "tiny.gguf", **Q4_K_M_LIKE)
    want = logits(model, IDS)  # fp32 on gguf.quants.dequantize of the file's blocks: the reference
    report = quantize_model(model, "q4", CPU, tmp_path / "tiny.gguf")
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.o_proj, Q4Linear) and isinstance(model.lm_head, Q4Linear)
    assert isinstance(layer.mlp.down_proj, Q4Linear) and isinstance(layer.self_attn.q_proj.stacked, Q4Linear)
    assert type(model.model.layers[1].mlp.down_proj) is torch.nn.Linear
    assert report.kept == {"model.layers.1.mlp.down_proj": "GGUF Q6_K"}
    assert "kept as loaded: model.layers.1.mlp.down_proj (GGUF Q6_K)" in report.describe()
    assert len(report.swapped) == 2 * 7 and report.max_abs_diff < 1e-6
    got = logits(model, IDS)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


def test_q4_k_in_bf16_runs_its_blocks_with_fp16_rounded_scales(tmp_path):
    model = tiny_llama_256()
    write_q4_gguf(model, tmp_path / "tiny.gguf", qtype=gguf.GGMLQuantizationType.Q4_K)
    one = [IDS[0][:1]]  # one row: the few-row kernels' (more than Q4_MAX_ROWS go to the bf16 oneDNN copy)
    fp32, fp32_one = logits(model, IDS), logits(model, one)
    dequantized = model.lm_head.weight.detach().clone()
    model = model.to(torch.bfloat16)
    bf16_error = (logits(model, IDS).float() - fp32).abs().max()
    bf16_error_one = (logits(model, one).float() - fp32_one).abs().max()
    report = quantize_model(model, "q4", CPU, tmp_path / "tiny.gguf")
    assert len(report.swapped) == 2 * 7 + 1 and not report.kept
    kernel = model.lm_head.kernel_weights
    assert (kernel is not None) == (q4_kernel.kernel() is not None)
    if kernel is not None:  # the GGUF's weights with d sc_j and dmin m_j rounded to fp16 (half an fp16 ulp each)
        held = torch.from_numpy(q4_kernel.unpacked(kernel))
        assert torch.allclose(held, dequantized, rtol=0, atol=4 * 2**-11 * float(dequantized.abs().max())), \
            (held - dequantized).abs().max()
    for rows, want, error in ((IDS, fp32, bf16_error), (one, fp32_one, bf16_error_one)):
        got = logits(model, rows)
        assert got.dtype == torch.bfloat16
        assert 0 < (got.float() - want).abs().max() < 1.5 * error, ((got.float() - want).abs().max(), error)


def test_q4_blocks_whose_scales_overflow_fp16_keep_torchs_int4_kernel():
    blocks = random_blocks(32, 64, 0)
    huge = Q4Blocks(blocks.q, blocks.scale * 1e5, blocks.zero * 1e5)
    assert Q4Linear(huge, None, torch.bfloat16).kernel_weights is None
    assert (Q4Linear(blocks, None, torch.bfloat16).kernel_weights is None) == (q4_kernel.kernel() is None)


def test_q4_in_bf16_computes_in_bf16_about_as_close_to_fp32_as_the_bf16_model(tmp_path):
    model = tiny_llama(tied=False)
    write_q4_gguf(model, tmp_path / "tiny.gguf")
    fp32 = logits(model, IDS)
    model = model.to(torch.bfloat16)  # what option.dtype=bf16 loads from the GGUF's safetensors cache
    bf16_error = (logits(model, IDS).float() - fp32).abs().max()
    report = quantize_model(model, "q4", CPU, tmp_path / "tiny.gguf")
    assert len(report.swapped) == 2 * 7 + 1 and report.max_abs_diff > 0, "bf16 loaded weights are rounded"
    kernel = model.lm_head.kernel_weights  # the Q4 kernel where the CPU has AVX-512 BF16, else torch's int4
    assert (kernel is not None) == (q4_kernel.kernel() is not None)
    assert kernel is not None or model.lm_head.scale_zero.dtype == torch.bfloat16
    if kernel is not None:  # held once, not as a buffer (surgery.own_remaining_tensors would copy it)
        assert not list(model.lm_head.buffers(recurse=False)) and model.lm_head.stored_bytes() >= kernel.packed.nbytes
    got = logits(model, IDS)
    assert got.dtype == torch.bfloat16
    # the int4 layers hold the GGUF's own weights; bf16 activations and scales round as the bf16 model does
    assert 0 < (got.float() - fp32).abs().max() < 1.5 * bf16_error, ((got.float() - fp32).abs().max(), bf16_error)


def test_q4_in_bf16_sends_more_than_a_few_rows_to_its_bf16_onednn_copy(tmp_path):
    model = tiny_llama(tied=False)
    write_q4_gguf(model, tmp_path / "tiny.gguf")
    model = model.to(torch.bfloat16)
    loaded = copy.deepcopy(model.model.layers[0].self_attn.o_proj)
    quantize_model(model, "q4", CPU, tmp_path / "tiny.gguf")
    layer = model.model.layers[0].self_attn.o_proj
    if torch.bfloat16 not in packable_dtypes():  # a CPU that only emulates bf16: the int4 kernel for every row count
        assert layer.dense is None
        return
    assert isinstance(layer.dense, OneDnnLinear) and model.model.layers[0].mlp.gate_proj.stacked.dense is not None
    x = torch.randn(Q4_MAX_ROWS + 1, layer.in_features).to(torch.bfloat16)
    few = layer(x[:Q4_MAX_ROWS])
    if layer.kernel_weights is not None:
        exact = x[:Q4_MAX_ROWS].double() @ torch.from_numpy(q4_kernel.unpacked(layer.kernel_weights)).double().T
        assert ((few.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6 * exact.abs().max()).all(), \
            "a few rows: the GGUF's blocks, rounded once to bf16"
    else:
        int4 = torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.packed, 32, layer.scale_zero)
        assert torch.equal(few, int4[:Q4_MAX_ROWS])
    assert torch.equal(layer(x), OneDnnLinear(loaded)(x)), "more rows: the loaded bf16 weights on oneDNN"
    assert not torch.equal(layer(x)[:Q4_MAX_ROWS], few), "premise: the two paths round differently"


def random_blocks(rows: int, columns: int, seed: int) -> Q4Blocks:
    rng = np.random.default_rng(seed)
    scale = rng.uniform(0.01, 0.1, (rows, columns // 32)).astype(np.float32)
    return Q4Blocks(rng.integers(0, 16, (rows, columns)).astype(np.uint8), scale,
                    (rng.normal(size=(rows, columns // 32)) * scale).astype(np.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_q4_slices_equal_the_separate_layers_and_rows_do_not_depend_on_the_batch(dtype):
    parts = [random_blocks(rows, 96, seed) for seed, rows in enumerate((64, 32, 48))]
    separate = [Q4Linear(blocks, None, dtype) for blocks in parts]
    stacked = Q4Linear(Q4Blocks.concatenated(parts), None, dtype)
    x = torch.randn(33, 96).to(dtype)
    for rows in (1, 2, 7, 33):
        assert torch.equal(stacked(x[:rows]), torch.cat([layer(x[:rows]) for layer in separate], dim=-1)), rows
    alone = torch.cat([stacked(x[i:i + 1]) for i in range(len(x))])
    assert torch.equal(alone, stacked(x)), "a row's output must not depend on the rows beside it"


def test_unpacked_blocks_are_what_gguf_dequantizes():
    weight = np.random.default_rng(0).normal(size=(48, 96)).astype(np.float32)
    for qtype in (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0,
                  gguf.GGMLQuantizationType.Q5_0):
        blocks = gguf.quants.quantize(weight, qtype)
        eight = qtype.name in ("Q8_0", "Q5_0")
        unpacked = unpack_q8_blocks(blocks, qtype.name) if eight else unpack_q4_blocks(blocks, qtype.name)
        theirs = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))
        assert torch.allclose(unpacked.dequantize(), theirs, atol=1e-6, rtol=0), qtype.name


@pytest.mark.skipif(not (cpu_has(*KERNELS["q8_vnni"].cpu_features) and omp_layer_loads()), reason="no AVX-512 VNNI (or numba's OpenMP layer) here")
def test_q4_in_bf16_runs_a_tied_q8_0_lm_head_on_its_blocks(tmp_path):
    model = tiny_llama(tied=True)
    write_q4_gguf(model, tmp_path / "tiny.gguf", skip={"lm_head"}, embedding=True,
                  embedding_type=gguf.GGMLQuantizationType.Q8_0)
    model = model.to(torch.bfloat16)
    embedding = model.get_input_embeddings().weight.detach().clone()
    before = logits(model, [IDS[0][:1]]).float()  # one row: the few-row kernels'
    report = quantize_model(model, "q4", CPU, tmp_path / "tiny.gguf")
    assert isinstance(model.lm_head, Q8Linear) and "lm_head" in report.swapped and not report.kept
    assert torch.equal(model.get_input_embeddings().weight, embedding), "the input embedding keeps its table"
    head = model.lm_head
    table = embedding.float().numpy()  # the GGUF's Q8_0 weights rounded to bf16
    assert np.allclose(vnni_matmul.unpacked(*head.vnni_weights), table, rtol=2**-8, atol=0), \
        "the lm_head holds the GGUF's Q8_0 weights"
    got = logits(model, [IDS[0][:1]]).float()  # bf16 rounding of both products apart: as close as two bf16 GEMVs
    assert torch.allclose(got, before, rtol=2**-6, atol=2**-6 * float(before.abs().max())), (got - before).abs().max()
    x = torch.randn(Q8_MAX_ROWS + 1, head.in_features).to(torch.bfloat16)
    assert torch.equal(head(x[:Q8_MAX_ROWS]), vnni_matmul.matmul(x[:Q8_MAX_ROWS], *head.vnni_weights))
    # held once: a buffer would be given a second copy by surgery.own_remaining_tensors
    assert not list(head.buffers(recurse=False)) and head.stored_bytes() >= sum(a.nbytes for a in head.vnni_weights)
    if head.dense is not None:  # more rows: the loaded table on oneDNN, as before the swap
        assert torch.equal(head(x), head.dense(x))


@pytest.mark.skipif(not (cpu_has(*KERNELS["q8_vnni"].cpu_features) and omp_layer_loads()), reason="no AVX-512 VNNI (or numba's OpenMP layer) here")
@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q5_0])
def test_q4_in_bf16_runs_an_int8_block_gguf_on_its_blocks(tmp_path, qtype):
    """A Q8_0 or Q5_0 GGUF (no 4-bit layer at all): every Linear on an int8 kernel in bf16 (the block kernel where
    it runs, test_block_linears.py, else the VNNI kernel); in fp32 nothing runs, said."""
    model = tiny_llama(tied=False)
    write_q4_gguf(model, tmp_path / "tiny.gguf", qtype)
    with pytest.raises(QuantizeError, match=r"holds no 4-bit weights .* \(nor 8-bit ones it can run"):
        quantize_model(copy.deepcopy(model), "q4", CPU, tmp_path / "tiny.gguf")
    model = model.to(torch.bfloat16)
    before = logits(model, [IDS[0][:1]]).float()
    report = quantize_model(model, "q4", CPU, tmp_path / "tiny.gguf")
    assert len(report.swapped) == 2 * 7 + 1 and not report.kept and len(report.stacked) == 2 * 5
    # q/k/v and gate/up stacked: 4 layers a decoder layer, on the block kernel where it runs (the layer chains
    # take it), where a lone Q8_0 lm_head stays on the VNNI kernel
    on_block = block_matmul.kernel() is not None
    head_on_vnni = qtype == gguf.GGMLQuantizationType.Q8_0 or not on_block
    assert sum(isinstance(m, BlockLinear) for m in model.modules()) == (2 * 4 + (not head_on_vnni) if on_block else 0)
    assert sum(isinstance(m, Q8Linear) for m in model.modules()) == (2 * 4 * (not on_block) + head_on_vnni)
    got = logits(model, [IDS[0][:1]]).float()
    assert torch.allclose(got, before, rtol=2**-6, atol=2**-6 * float(before.abs().max())), (got - before).abs().max()


@pytest.mark.skipif(not (cpu_has(*KERNELS["q8_vnni"].cpu_features) and omp_layer_loads()), reason="no AVX-512 VNNI (or numba's OpenMP layer) here")
def test_stacked_q8_layers_equal_the_separate_ones_bit_for_bit():
    rng = np.random.default_rng(3)
    parts = [Q8Blocks(rng.integers(-127, 128, (rows, 64), dtype=np.int8), rng.random((rows, 2), np.float32) / 100)
             for rows in (64, 32, 32)]
    x = torch.randn(Q8_MAX_ROWS, 64).to(torch.bfloat16)
    separate = torch.cat([Q8Linear(part, None)(x) for part in parts], dim=1)
    assert torch.equal(Q8Linear(Q8Blocks.concatenated(parts), None)(x), separate)


def test_q4_keeps_a_tied_q8_0_lm_head_where_activations_are_fp32(tmp_path):
    model = tiny_llama(tied=True)
    write_q4_gguf(model, tmp_path / "tiny.gguf", skip={"lm_head"}, embedding=True,
                  embedding_type=gguf.GGMLQuantizationType.Q8_0)
    report = quantize_model(model, "q4", CPU, tmp_path / "tiny.gguf")
    assert report.kept == {"lm_head": "tied to the input embedding, GGUF Q8_0"}
    assert model.lm_head.weight is model.get_input_embeddings().weight


def test_q4_keeps_a_tied_lm_head_in_fp32(tmp_path):
    model = tiny_llama(tied=True)
    embedding = model.get_input_embeddings().weight.detach().clone()
    write_q4_gguf(model, tmp_path / "tiny.gguf", skip={"lm_head"}, embedding=True)
    report = quantize_model(model, "q4", CPU, tmp_path / "tiny.gguf")
    assert report.kept == {"lm_head": "tied to the input embedding, GGUF F32"} and len(report.swapped) == 2 * 7
    assert model.lm_head.weight is model.get_input_embeddings().weight and torch.equal(model.lm_head.weight, embedding)


def test_q4_refuses_weights_that_are_not_the_ggufs(tmp_path):
    write_q4_gguf(tiny_llama(tied=False), tmp_path / "tiny.gguf")
    other = tiny_llama(tied=False, seed=1)  # same shapes, other weights
    with pytest.raises(QuantizeError, match=r"^option\.quantize=q4: .* differ from the loaded weights"):
        quantize_model(other, "q4", CPU, tmp_path / "tiny.gguf")
    assert not any(isinstance(m, Q4Linear) for m in other.modules()), "a refused swap leaves the model as it was"


def test_q4_needs_a_gguf_and_quantize_needs_the_cpu():
    with pytest.raises(QuantizeError, match=r"^option\.quantize=q4 .* loaded from neither a GGUF file nor a 4-bit AWQ"):
        quantize_model(tiny_llama(tied=False), "q4", CPU, None)
    with pytest.raises(QuantizeError, match=r"^option\.quantize=fp16: .* CPU kernels .* cuda"):
        quantize_model(tiny_llama(tied=False), "fp16", torch.device("cuda"))
    model = tiny_llama(tied=False)
    assert not quantize_model(model, "none", CPU).swapped
    assert isinstance(model.lm_head, torch.nn.Linear)


def test_config_validates_quantize():
    def config(**values) -> ModelConfig:
        from lmi_serve.config.sources import load_model_config

        return load_model_config(None, {"OPTION_MODEL_ID": "x", **values})

    assert config().quantize == "none" and config(OPTION_QUANTIZE="FP16").quantize == "fp16"
    assert config(OPTION_QUANTIZE="q4").quantize == "q4"
    with pytest.raises(ConfigError, match=r"^OPTION_QUANTIZE: 'int8' is not one of none, fp16, q4"):
        config(OPTION_QUANTIZE="int8")
    with pytest.raises(ConfigError, match=r"^OPTION_QUANTIZE: option\.quantize=fp16 .* option\.dtype=bf16"):
        config(OPTION_QUANTIZE="fp16", OPTION_DTYPE="bf16")
    assert (config(OPTION_QUANTIZE="q4", OPTION_DTYPE="bf16").quantize, config(OPTION_DTYPE="bf16").dtype) == \
        ("q4", "bf16")
    with pytest.raises(ConfigError, match=r"^OPTION_QUANTIZE: option\.quantize=q4 .* option\.dtype=fp16"):
        config(OPTION_QUANTIZE="q4", OPTION_DTYPE="fp16")


def test_quantize_refuses_a_model_loaded_in_a_dtype_it_does_not_compute_in(tmp_path):
    model = tiny_llama(tied=False)
    write_q4_gguf(model, tmp_path / "tiny.gguf")
    with pytest.raises(QuantizeError, match=r"^option\.quantize=fp16 computes in fp32, .* loaded in bfloat16"):
        quantize_model(copy.deepcopy(model).to(torch.bfloat16), "fp16", CPU)
    with pytest.raises(QuantizeError, match=r"^option\.quantize=q4 computes in fp32 or bf16, .* loaded in float16"):
        quantize_model(model.to(torch.float16), "q4", CPU, tmp_path / "tiny.gguf")


PROMPTS = [[5, 17, 99], [9, 8, 7, 6, 5, 4, 3, 2, 11, 12, 13], [300, 301], [42] * 6]


def greedy(model, tokenizer, prompts) -> list[list[int]]:
    requests = [GenerationRequest(tuple(p), stop=StopParams(max_new_tokens=8, ignore_eos=True)) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    for owner, event in generate_static_batch(model, tokenizer, CPU, requests):
        out[owner].append(event.token_id)
    return out


@pytest.mark.parametrize("mode", ["fp16", "q4"])
def test_quantized_greedy_is_batch_invariant_and_deterministic(tmp_path, mode, smollm2_tokenizer):
    model = tiny_llama(tied=False)
    write_q4_gguf(model, tmp_path / "tiny.gguf")
    quantize_model(model, mode, CPU, tmp_path / "tiny.gguf")
    batched = greedy(model, smollm2_tokenizer, PROMPTS)
    alone = [greedy(model, smollm2_tokenizer, [p])[0] for p in PROMPTS]
    assert batched == alone and greedy(model, smollm2_tokenizer, PROMPTS) == batched
    assert len({tuple(row) for row in batched}) > 1, "premise: the output must depend on the prompt"


def test_fp16_swap_is_generic_encoder_decoder_too():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_ff=64, num_layers=2, num_heads=4,
                                                d_kv=8, decoder_start_token_id=0, pad_token_id=0)).eval()
    assert model.lm_head.weight is model.get_input_embeddings().weight, "premise: T5's lm_head is tied"
    reference = fp16_rounded_copy(model)
    report = quantize_model(model, "fp16", CPU)
    assert report.swapped and not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    inputs = {"input_ids": torch.tensor(IDS), "decoder_input_ids": torch.tensor([[0, 5, 6], [0, 7, 8]])}
    with torch.inference_mode():
        got, want = model(**inputs).logits, reference(**inputs).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
