"""kernels/cpu/decode_kernel.py: the CPU decode attention equals torch's SDPA (fp32; bf16 K/V to bf16's rounding of
the output), is exactly batch-invariant, reads the slot cache's views in place, and leaves to SDPA what it
does not take."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmi_serve.engine.kv import slot_attention
from lmi_serve.kernels.cpu import decode_kernel

pytestmark = pytest.mark.skipif(decode_kernel.kernel() is None, reason="numba's OpenMP layer is unavailable")

DIM = 64


def _in_buffer(rows: int, heads: int, columns: int, capacity: int, first: int, generator) -> torch.Tensor:
    """A view [rows, heads, columns, DIM] at column `first` of a larger buffer, as a slot part keeps K/V."""
    store = torch.randn(rows + 2, heads, capacity, DIM, generator=generator)
    return store[:rows, :, first:first + columns]


def _sdpa(query, key, value, mask):
    groups = query.shape[1] // key.shape[1]
    out = F.scaled_dot_product_attention(query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1),
                                         attn_mask=mask, scale=DIM ** -0.5)
    return out.transpose(1, 2)


def _padded_mask(lengths: list[int], columns: int) -> torch.Tensor:
    mask = torch.zeros(len(lengths), 1, 1, columns, dtype=torch.bool)
    for row, length in enumerate(lengths):
        mask[row, ..., columns - length:] = True
    return mask


@pytest.mark.parametrize("query_heads,heads", [(9, 3), (4, 4), (8, 2)])
@pytest.mark.parametrize("mask_kind", ["none", "padded", "shared", "window"])
@pytest.mark.parametrize("in_buffer", [True, False])
def test_the_kernel_equals_sdpa(query_heads, heads, mask_kind, in_buffer):
    generator = torch.Generator().manual_seed(query_heads * 31 + heads)
    rows, columns = 6, 37
    if in_buffer:
        key = _in_buffer(rows, heads, columns, 64, 5, generator)
        value = _in_buffer(rows, heads, columns, 64, 5, generator)
    else:
        key = torch.randn(rows, heads, columns, DIM, generator=generator)
        value = torch.randn(rows, heads, columns, DIM, generator=generator)
    query = torch.randn(rows, query_heads, 1, DIM, generator=generator) * 3  # peaked softmax: tiny probabilities too
    mask = {"none": None, "padded": _padded_mask([37, 1, 20, 36, 5, 30], columns),
            "shared": _padded_mask([25], columns),
            "window": _padded_mask([20] * rows, columns) & ~_padded_mask([4] * rows, columns)}[mask_kind]
    assert decode_kernel.eligible(query, key, value, mask)
    out = decode_kernel.attend(query, key, value, mask, DIM ** -0.5)
    assert out is not None and out.shape == (rows, 1, query_heads, DIM)
    torch.testing.assert_close(out, _sdpa(query, key, value, mask), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim", [8, 16, 72, 80, 128, 152])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dims_in_fours_of_16_lanes_and_their_remainder_equal_sdpa(dim, dtype):
    """The values are summed 64 dims at a time, then 16 at a time, then one by one: each of those splits."""
    generator = torch.Generator().manual_seed(dim)
    rows, heads, columns = 3, 2, 90
    key = torch.randn(rows + 1, heads, columns + 6, dim, generator=generator)[:rows, :, 6:]
    value = torch.randn(rows + 1, heads, columns + 6, dim, generator=generator)[:rows, :, 6:]
    query = torch.randn(rows, 4, 1, dim, generator=generator) * 2
    mask = _padded_mask([90, 3, 70], columns)
    mask[2, ..., -5:] = False  # masked columns after the first attended one too (a window)
    exact = F.scaled_dot_product_attention(query.to(dtype).float(), key.to(dtype).float().repeat_interleave(2, 1),
                                           value.to(dtype).float().repeat_interleave(2, 1), attn_mask=mask,
                                           scale=dim ** -0.5).transpose(1, 2)
    for row, masked in ((1, slice(0, 87)), (2, slice(-5, None))):  # a masked column's K/V never reach the result
        key[row, :, masked], value[row, :, masked] = float("nan"), float("inf")
    out = decode_kernel.attend(query.to(dtype), key.to(dtype), value.to(dtype), mask, dim ** -0.5)
    assert out is not None and out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(out.float(), exact, rtol=tolerance, atol=1e-5)


@pytest.mark.parametrize("mask_kind", ["none", "padded"])
def test_bf16_k_v_are_read_as_their_fp32_widening_and_the_output_rounded_once(mask_kind):
    """bf16 in, bf16 out: the kernel's result is the fp32 attention of the bf16 values, rounded to bf16 once
    (within one bf16 step of it; SDPA's own bf16 kernel is held to the same), and where the fp32 kernel
    attends the widened tensors, the bf16 kernel rounds its very result."""
    generator = torch.Generator().manual_seed(11)
    rows, heads, query_heads, columns = 5, 3, 9, 41
    key = _in_buffer(rows, heads, columns, 64, 9, generator).bfloat16()
    value = _in_buffer(rows, heads, columns, 64, 9, generator).bfloat16()
    query = (torch.randn(rows, query_heads, 1, DIM, generator=generator) * 3).bfloat16()
    mask = None if mask_kind == "none" else _padded_mask([41, 2, 30, 17, 40], columns)
    assert decode_kernel.eligible(query, key, value, mask)
    out = decode_kernel.attend(query, key, value, mask, DIM ** -0.5)
    assert out is not None and out.dtype == torch.bfloat16 and out.shape == (rows, 1, query_heads, DIM)
    exact = _sdpa(query.float(), key.float(), value.float(), mask)
    torch.testing.assert_close(out.float(), exact, rtol=2 ** -8, atol=1e-6)
    widened = decode_kernel.attend(query.float(), key.float(), value.float(), mask, DIM ** -0.5)
    assert torch.equal(out, widened.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_bit_for_bit_the_same_alone_and_in_any_batch(dtype):
    """A row's result depends on its own query, columns and mask only: not on its neighbours, their
    number or the padding the batch gives it (SDPA's blocks move with the padding)."""
    generator = torch.Generator().manual_seed(7)
    heads, query_heads, length = 3, 9, 50
    key_row = torch.randn(1, heads, length, DIM, generator=generator)
    value_row = torch.randn(1, heads, length, DIM, generator=generator)
    query_row = torch.randn(1, query_heads, 1, DIM, generator=generator)
    outputs = []
    for rows, padding in [(4, 0), (5, 13), (8, 200)]:
        key = torch.randn(rows, heads, length + padding, DIM, generator=generator)
        value = torch.randn(rows, heads, length + padding, DIM, generator=generator)
        query = torch.randn(rows, query_heads, 1, DIM, generator=generator)
        place = rows - 2
        key[place, :, padding:], value[place, :, padding:], query[place] = key_row[0], value_row[0], query_row[0]
        lengths = [length + padding] * rows
        lengths[place] = length
        out = decode_kernel.attend(query.to(dtype), key.to(dtype), value.to(dtype),
                                   _padded_mask(lengths, length + padding), DIM ** -0.5)
        outputs.append(out[place])
    assert all(torch.equal(outputs[0], other) for other in outputs[1:])


def test_what_the_kernel_does_not_take_is_refused_or_left_to_sdpa():
    rows, heads, columns = 4, 3, 10
    key = torch.randn(rows, heads, columns, DIM)
    query = torch.randn(rows, 9, 1, DIM)
    assert decode_kernel.eligible(query, key, key, None)
    assert not decode_kernel.eligible(torch.randn(rows, 9, 2, DIM), key, key, None)  # a prefill
    assert decode_kernel.eligible(query.bfloat16(), key.bfloat16(), key.bfloat16(), None)
    for rows in (1, 2):  # any number of rows, fp32 and bf16
        for dtype in (torch.float32, torch.bfloat16):
            part = [x[:rows].to(dtype) for x in (query, key)]
            assert decode_kernel.eligible(part[0], part[1], part[1], None)
    assert not decode_kernel.eligible(query.half(), key.half(), key.half(), None)  # fp16: SDPA
    assert not decode_kernel.eligible(query.bfloat16(), key, key, None)  # mixed dtypes
    assert not decode_kernel.eligible(query, key, key, torch.zeros(rows, 1, 1, columns))  # an additive mask
    assert not decode_kernel.eligible(query, key, key, torch.ones(rows, 1, 2, columns, dtype=torch.bool))
    # K/V whose columns are not rows of a [.., capacity, dim] buffer: not read in place, SDPA attends
    strided = torch.randn(rows, heads, DIM, columns).transpose(2, 3)
    assert decode_kernel.attend(query, strided, strided, None, DIM ** -0.5) is None


class _Attention(torch.nn.Module):
    num_key_value_groups = 3


def test_decode_attention_runs_the_kernel_for_an_fp32_decode_step(monkeypatch):
    calls = []
    attend = decode_kernel.attend
    monkeypatch.setattr(decode_kernel, "attend", lambda *args: calls.append(1) or attend(*args))
    generator = torch.Generator().manual_seed(3)
    key = _in_buffer(5, 3, 20, 32, 7, generator)
    value = _in_buffer(5, 3, 20, 32, 7, generator)
    query = torch.randn(5, 9, 1, DIM, generator=generator)
    mask = _padded_mask([20, 3, 11, 20, 8], 20)
    out, _ = slot_attention.decode_attention(_Attention(), query, key, value, mask, scaling=DIM ** -0.5)
    assert calls == [1]
    torch.testing.assert_close(out, _sdpa(query, key, value, mask), rtol=1e-5, atol=1e-5)
    out, _ = slot_attention.decode_attention(_Attention(), query.double(), key.double(), value.double(), mask,
                                             scaling=DIM ** -0.5)
    assert calls == [1]  # fp64: SDPA


def test_its_exp_is_within_4e_7_and_zero_below_the_floor():
    """The kernel's own exp (plain arithmetic, so a block's vectorise): within 4e-7 of exp, relative, for x
    in (floor, 0] (fp32's rounding is 6e-8), exactly 1 at 0, and 0 at the floor, below it and at -inf (a
    masked column)."""
    import numpy as np

    xs = np.concatenate([-np.random.default_rng(0).uniform(0, 86.9, 4000), [-1e-30, -0.5, -0.6931472, -86.9]])
    for x in xs.astype(np.float32):
        got, want = float(decode_kernel._exp(x)), np.exp(np.float64(x))
        assert abs(got - want) <= 4e-7 * want, (x, got, want)
    assert decode_kernel._exp(np.float32(0.0)) == 1.0
    for x in (-87.0, -100.0, -np.inf):
        assert decode_kernel._exp(np.float32(x)) == 0.0
