"""Pre-quantized checkpoint formats (model/quantized/): recognised from config.json, unpacked exactly.

- Layouts against their specs: an int32 of known nibbles unpacks to the columns AWQ's interleaved order
  and GPTQ's row order say; GPTQ v1's stored zero is the zero minus one, v2's the zero itself.
- Our packers (written from the same specs) round-trip every code, scale and zero exactly, for AWQ and
  GPTQ (sym/asym, groups 32-128 and per channel, desc_act with a shuffled g_idx, 4 and 8 bits), and the
  dequantized weight is within the quantization step of the float weight it came from.
- compressed-tensors: the library's own compressors pack (W4A16 sym/asym, W8A16, W8A8, FP8 per channel,
  per tensor and per block); our unpacking gives its codes and its decompressed weights bit for bit.
- Detection names each format; every other method is refused with a message naming it.
"""

from __future__ import annotations

import pytest
import torch

from lmi_serve.model.quantized.awq import AWQ_ORDER, pack_awq, unpack_awq
from lmi_serve.model.quantized.compressed import dequantize_fp8, int8_weight, unpack_pack_quantized
from lmi_serve.model.quantized.detect import QuantFormat, quantization_of
from lmi_serve.model.quantized.gptq import pack_gptq, unpack_gptq
from lmi_serve.model.quantized.weights import IntWeight, dequantize, pack_int32, quantize_int, unpack_int32
from lmi_serve.model.source import ModelLoadError

NIBBLES = 0x76543210  # nibble k (lowest first) holds the value k


def random_weight(out: int, width: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(out, width, generator=generator) * 0.05


def assert_same(left: IntWeight, right: IntWeight) -> None:
    assert left.bits == right.bits
    assert torch.equal(left.codes, right.codes)
    assert torch.equal(left.scales, right.scales)
    assert torch.equal(left.zeros, right.zeros)
    assert torch.equal(left.g_idx, right.g_idx)


# -- layouts against the specs ---------------------------------------------------------------------------


def test_awq_nibbles_hold_columns_in_interleaved_order():
    """AWQ packs columns 0, 2, 4, 6, 1, 3, 5, 7 into nibbles 0..7: nibble k's value k lands in column
    AWQ_PACK_ORDER[k], so columns 0..7 read 0, 4, 1, 5, 2, 6, 3, 7."""
    qweight = torch.tensor([[NIBBLES]], dtype=torch.int32)  # one input row, eight output columns
    qzeros = torch.tensor([[0x11111111]], dtype=torch.int32)
    weight = unpack_awq(qweight, qzeros, torch.ones(1, 8, dtype=torch.float16))
    assert weight.codes[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert AWQ_ORDER == (0, 4, 1, 5, 2, 6, 3, 7)
    assert dequantize(weight)[:, 0].tolist() == [-1, 3, 0, 4, 1, 5, 2, 6]  # zero point 1, no offset


def test_awq_known_answers_with_the_sign_bit_set():
    """The known answers of a published AWQ dequantize test (vLLM's Triton AWQ dequantizer task): words
    0x76543210 and 0xfedcba98 (a negative int32), zeros 0x11111111 and 0x88888888, scales 1..8."""
    qweight = torch.tensor([[NIBBLES], [-19088744]], dtype=torch.int32)  # -19088744 is 0xfedcba98
    qzeros = torch.tensor([[0x11111111], [-2004318072]], dtype=torch.int32)  # 0x88888888
    scales = torch.arange(1, 9, dtype=torch.float16).repeat(2, 1)
    weight = unpack_awq(qweight, qzeros, scales)  # two input rows, each its own group
    assert dequantize(weight).t().tolist() == [[-1, 6, 0, 16, 5, 30, 14, 48], [0, 8, 3, 20, 10, 36, 21, 56]]


def test_gptq_rows_in_bit_order_and_v1_zero_offset():
    """GPTQ packs eight input rows into one int32 of each output column, lowest nibble first; v1 stores
    zero - 1 (0x77777777: a symmetric layer's zero 8), v2 the zero itself."""
    qweight = torch.tensor([[NIBBLES] * 8], dtype=torch.int32)  # 8 input rows, 8 output columns
    qzeros = torch.tensor([[0x77777777]], dtype=torch.int32)
    scales = torch.full((1, 8), 0.5, dtype=torch.float16)
    v1 = unpack_gptq(qweight, qzeros, scales, None, bits=4, group_size=8, checkpoint_format="gptq")
    v2 = unpack_gptq(qweight, qzeros, scales, None, bits=4, group_size=8, checkpoint_format="gptq_v2")
    assert v1.codes[0].tolist() == list(range(8))
    assert v1.zeros.unique().tolist() == [8.0] and v2.zeros.unique().tolist() == [7.0]
    assert dequantize(v1)[0].tolist() == [(k - 8) * 0.5 for k in range(8)]
    # AutoGPTQ's dequantizer adds the one back modulo 16: a stored 15 is zero 0
    wrapped = unpack_gptq(qweight, torch.tensor([[-1]], dtype=torch.int32), scales, None, bits=4, group_size=8)
    assert wrapped.zeros.unique().tolist() == [0.0]


def test_gptq_8bit_packs_four_rows_to_an_int32():
    qweight = torch.tensor([[0x04030201] * 4], dtype=torch.int32)  # rows 0..3 of four columns: 1, 2, 3, 4
    qzeros = torch.tensor([[0x7F7F7F7F]], dtype=torch.int32)  # four columns' zeros, v1: 127 + 1
    weight = unpack_gptq(qweight, qzeros, torch.ones(1, 4, dtype=torch.float16), None, bits=8, group_size=4)
    assert weight.codes[0].tolist() == [1, 2, 3, 4] and weight.zeros.tolist() == [[128.0]] * 4


def test_unpack_int32_inverts_pack_int32_along_either_dim():
    codes = torch.randint(0, 16, (16, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    for dim in (0, 1):
        assert torch.equal(unpack_int32(pack_int32(codes, 4, dim), 4, dim), codes)
    assert torch.equal(unpack_int32(pack_int32(codes, 4, 1, AWQ_ORDER), 4, 1, AWQ_ORDER), codes)
    assert pack_int32(torch.arange(8).reshape(1, 8), 4, 1).item() == NIBBLES


# -- our packers round-trip, and dequantize within the quantization step -----------------------------------


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_pack_unpack_round_trip(group_size):
    weight = random_weight(48, 256)
    quantized = quantize_int(weight, 4, group_size, symmetric=False)
    unpacked = unpack_awq(**pack_awq(quantized))
    assert_same(unpacked, quantized)
    step = quantized.scales[:, quantized.g_idx]
    error = (dequantize(unpacked) - weight).abs()
    assert bool((error <= step * 1.01).all()) and float((error / step).mean()) < 0.3


@pytest.mark.parametrize("bits,group_size,symmetric,desc_act,layout", [
    (4, 128, True, False, "gptq"), (4, 32, False, False, "gptq"), (4, 64, True, True, "gptq"),
    (4, -1, True, False, "gptq"), (4, 128, False, True, "gptq_v2"), (8, 128, True, False, "gptq"),
    (8, 64, False, True, "gptq_v2")])
def test_gptq_pack_unpack_round_trip(bits, group_size, symmetric, desc_act, layout):
    out, width = 40, 256
    weight = random_weight(out, width, seed=bits + group_size)
    g_idx = None
    if desc_act:  # activation order: column i's group is the group of its place in a permutation
        order = torch.randperm(width, generator=torch.Generator().manual_seed(3))
        g_idx = torch.empty(width, dtype=torch.int64)
        g_idx[order] = torch.arange(width) // group_size
    quantized = quantize_int(weight, bits, group_size, symmetric=symmetric, g_idx=g_idx)
    packed = pack_gptq(quantized, layout)
    unpacked = unpack_gptq(packed["qweight"], packed["qzeros"], packed["scales"],
                           packed["g_idx"] if desc_act else None, bits=bits, group_size=group_size,
                           checkpoint_format=layout)
    assert_same(unpacked, quantized)
    assert (unpacked.group_size is None) == desc_act
    step = quantized.scales[:, quantized.g_idx]
    assert bool(((dequantize(unpacked) - weight).abs() <= step * 1.01).all())


def test_gptq_v1_and_v2_of_the_same_weight_differ_only_in_stored_zeros():
    quantized = quantize_int(random_weight(16, 128), 4, 32, symmetric=False)
    v1, v2 = pack_gptq(quantized, "gptq"), pack_gptq(quantized, "gptq_v2")
    assert torch.equal(v1["qweight"], v2["qweight"]) and not torch.equal(v1["qzeros"], v2["qzeros"])
    as_v2 = unpack_gptq(v1["qweight"], v1["qzeros"], v1["scales"], None, bits=4, group_size=32,
                        checkpoint_format="gptq_v2")
    assert torch.equal(as_v2.zeros, (quantized.zeros - 1) % 16)  # read with the wrong format: off by one


# -- compressed-tensors: the library packs, we unpack -------------------------------------------------------


@pytest.fixture(scope="module")
def ct():
    import compressed_tensors  # the test extra's reference (pyproject.toml): a missing one is a failure, not a skip

    return compressed_tensors


def _ct_compress(layout: str, weights: dict, weight: torch.Tensor, inputs: dict | None = None):
    """The library's compressed state dict of `weight`, its decompressed weight and its quantized codes."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(targets=["Linear"], weights=args,
                                input_activations=QuantizationArgs(**inputs) if inputs else None)
    out, width = weight.shape
    if args.strategy == "group":
        view = weight.reshape(out, width // args.group_size, args.group_size)
        low, high = view.amin(-1), view.amax(-1)
    elif args.strategy == "channel":
        low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    elif args.strategy == "block":
        rows, cols = args.block_structure
        view = weight.reshape(out // rows, rows, width // cols, cols)
        low, high = view.amin((1, 3)), view.amax((1, 3))
    else:
        low, high = weight.amin().reshape(1), weight.amax().reshape(1)
    scale, zero_point = calculate_qparams(low, high, args)
    state = {"weight": weight, "weight_scale": scale}
    if not args.symmetric:
        state["weight_zero_point"] = zero_point
    compressor = BaseCompressor.get_value_from_registry(layout)
    compressed = compressor.compress(dict(state), scheme)
    codes = quantize(x=weight, scale=scale, zero_point=zero_point if not args.symmetric else None, args=args,
                     dtype=torch.int8 if args.type == "int" else None)
    return compressed, compressor.decompress(dict(compressed), scheme)["weight"], codes


@pytest.mark.parametrize("weights", [
    {"num_bits": 4, "symmetric": True, "strategy": "group", "group_size": 32},
    {"num_bits": 4, "symmetric": True, "strategy": "group", "group_size": 128},
    {"num_bits": 4, "symmetric": False, "strategy": "group", "group_size": 64},
    {"num_bits": 4, "symmetric": True, "strategy": "channel"},
    {"num_bits": 8, "symmetric": True, "strategy": "channel"},
    {"num_bits": 8, "symmetric": False, "strategy": "group", "group_size": 128}])
def test_pack_quantized_matches_the_library(ct, weights):
    weight = random_weight(40, 256, seed=weights["num_bits"])
    compressed, reference, codes = _ct_compress("pack-quantized", weights, weight)
    ours = unpack_pack_quantized(compressed["weight_packed"], compressed["weight_scale"],
                                 compressed["weight_shape"], bits=weights["num_bits"],
                                 weight_zero_point=compressed.get("weight_zero_point"))
    offset = 1 << (weights["num_bits"] - 1)
    assert torch.equal(ours.codes.to(torch.int16) - offset, codes.to(torch.int16))
    assert torch.equal(dequantize(ours).to(reference.dtype), reference)


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_int8_w8a8_matches_the_library(ct, strategy):
    weight = random_weight(32, 128, seed=5)
    inputs = {"num_bits": 8, "symmetric": True, "strategy": "token", "dynamic": True}
    compressed, reference, _ = _ct_compress("int-quantized", {"num_bits": 8, "symmetric": True,
                                                              "strategy": strategy}, weight, inputs)
    assert compressed["weight"].dtype == torch.int8
    ours = int8_weight(compressed["weight"], compressed["weight_scale"])
    assert torch.equal(ours.codes.to(torch.int16) - 128, compressed["weight"].to(torch.int16))
    assert torch.equal(dequantize(ours).to(reference.dtype), reference)


@pytest.mark.parametrize("weights", [
    {"strategy": "channel"}, {"strategy": "tensor"}, {"strategy": "block", "block_structure": [16, 32]}])
def test_fp8_matches_the_library(ct, weights):
    weight = random_weight(32, 128, seed=7)
    inputs = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
    args = {"num_bits": 8, "type": "float", "symmetric": True, **weights}
    compressed, reference, _ = _ct_compress("float-quantized", args, weight, inputs)
    assert compressed["weight"].dtype == torch.float8_e4m3fn
    block = tuple(weights["block_structure"]) if "block_structure" in weights else None
    ours = dequantize_fp8(compressed["weight"], compressed["weight_scale"], block)
    assert torch.equal(ours.to(reference.dtype), reference)
    assert float((ours - weight).abs().max()) < 0.07 * float(weight.abs().max())


# -- detection and refusals ---------------------------------------------------------------------------------


def _ct_config(layout: str, weights: dict, inputs: dict | None = None) -> dict:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs, "format": layout}
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": layout,
                                    "config_groups": {"group_0": group}, "ignore": ["lm_head"],
                                    "quantization_status": "compressed"}}


def test_detects_awq_gptq_and_compressed_tensors():
    awq = quantization_of({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 64,
                                                   "zero_point": True, "version": "GEMM"}})
    assert awq == QuantFormat("awq", "W4A16", "gemm", 4, 64, symmetric=False)
    gptq = quantization_of({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                                    "desc_act": True, "sym": False,
                                                    "checkpoint_format": "gptq_v2"}})
    assert (gptq.layout, gptq.desc_act, gptq.symmetric, gptq.scheme) == ("gptq_v2", True, False, "W4A16")
    w4a16 = quantization_of(_ct_config("pack-quantized", {"num_bits": 4, "type": "int", "symmetric": True,
                                                          "strategy": "group", "group_size": 128}))
    assert (w4a16.scheme, w4a16.group_size, w4a16.not_converted) == ("W4A16", 128, ("lm_head",))
    w8a8 = quantization_of(_ct_config("int-quantized", {"num_bits": 8, "type": "int", "strategy": "channel"},
                                      {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}))
    assert (w8a8.scheme, w8a8.activations, w8a8.group_size) == ("W8A8", "int8 dynamic token", -1)
    fp8 = quantization_of(_ct_config("float-quantized", {"num_bits": 8, "type": "float", "strategy": "block",
                                                         "block_structure": [128, 128]}))
    assert (fp8.scheme, fp8.block_structure) == ("FP8", (128, 128))
    assert quantization_of({"model_type": "llama"}) is None


@pytest.mark.parametrize("quant,named", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
    ({"load_in_8bit": True}, "bitsandbytes"),
    ({"quant_method": "exl2", "bits": 4.65}, "exl2"),
    ({"quant_method": "hqq", "nbits": 4}, "hqq"),
    ({"quant_method": "eetq", "weights": "int8"}, "eetq"),
    ({"quant_method": "aqlm"}, "aqlm"),
    ({"quant_method": "torchao"}, "torchao"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "fp8"),
    ({"quant_method": "something-new"}, "something-new"),
    ({"quant_method": "gptq", "bits": 4, "is_marlin_format": True}, "is_marlin_format"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "'marlin'"),
    ({"quant_method": "gptq", "bits": 3}, "3-bit"),
    ({"quant_method": "awq", "bits": 4, "version": "marlin"}, "'marlin'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "'gemv'"),
    (_ct_config("nvfp4-pack-quantized", {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                         "group_size": 16})["quantization_config"], "nvfp4-pack-quantized"),
    (_ct_config("marlin-24", {"num_bits": 4, "type": "int"})["quantization_config"], "marlin-24")])
def test_refuses_other_methods_naming_them(quant, named):
    with pytest.raises(ModelLoadError, match="does not load") as refused:
        quantization_of({"quantization_config": quant})
    message = str(refused.value)
    assert named in message and "use " in message and "\n" not in message
