"""The rotary kernel (kernels/cpu/rotary_kernel.py): q and k rotated in one numba call with torch's bits.

- fp32 and bf16, one token and several, cos and sin shared by the batch or per row: torch's
  `x * cos + roll(x, half) * sin` bit for bit, read from a stacked output's columns where they are;
- what it does not take (a long prompt, an odd width, another dtype) is None: torch's ops rotate.
(A model's logits with it: tests/unit/model/test_lean_layers.py.)
"""

from __future__ import annotations

import pytest
import torch

from lmi_serve.kernels.cpu import rotary_kernel

pytestmark = pytest.mark.skipif(rotary_kernel.kernel() is None, reason="numba missing here")

HEADS, DIM = 12, 64


def stacked_output(batch: int, tokens: int, dtype: torch.dtype, generator) -> torch.Tensor:
    """A q/k/v projection's output: q and k heads, then v's columns."""
    return (torch.randn(batch, tokens, (HEADS + 3) * DIM, generator=generator) * 2).to(dtype)


def torch_rotation(stacked: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    batch, tokens = stacked.shape[:2]
    x = stacked[..., :HEADS * DIM].view(batch, tokens, HEADS, DIM).transpose(1, 2)
    return x * cos + x.roll(DIM // 2, -1) * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,tokens,shared", [(1, 1, True), (4, 1, False), (2, 7, False), (3, 5, True)])
def test_the_rotation_is_torchs_bit_for_bit(dtype, batch, tokens, shared):
    generator = torch.Generator().manual_seed(batch * 10 + tokens)
    stacked = stacked_output(batch, tokens, dtype, generator)
    cos, sin = (torch.randn(1 if shared else batch, 1, tokens, DIM, generator=generator).to(dtype) for _ in range(2))
    got = rotary_kernel.rotate(stacked, HEADS, DIM, cos, sin)
    assert got is not None and got.shape == (batch, HEADS, tokens, DIM) and got.is_contiguous()
    assert torch.equal(got, torch_rotation(stacked, cos, sin))


def test_what_it_does_not_take_is_left_to_torch():
    generator = torch.Generator().manual_seed(0)
    stacked = stacked_output(1, 2, torch.float32, generator)
    cos = sin = torch.randn(1, 1, 2, DIM, generator=generator)
    assert rotary_kernel.rotate(stacked.half(), HEADS, DIM, cos.half(), sin.half()) is None  # fp16
    assert rotary_kernel.rotate(stacked, HEADS, DIM, cos.bfloat16(), sin.bfloat16()) is None  # mixed dtypes
    assert rotary_kernel.rotate(stacked, 64, DIM, cos, sin) is None  # more heads than the columns hold
    long = stacked_output(1, rotary_kernel.MAX_ELEMENTS // (HEADS * DIM) + 1, torch.float32, generator)
    table = torch.randn(1, 1, long.shape[1], DIM, generator=generator)
    assert rotary_kernel.rotate(long, HEADS, DIM, table, table) is None
    assert rotary_kernel.rotate(stacked, HEADS, DIM, cos.transpose(2, 3).contiguous().transpose(2, 3)[..., :2, :],
                                sin) is None  # a table not contiguous
