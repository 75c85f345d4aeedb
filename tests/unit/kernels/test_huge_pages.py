"""fp32 storage on transparent huge pages (kernels/cpu/huge_pages.py), and the row kernel's copies on it.

- `floats(n)` is n writable floats starting on a 2 MiB boundary, in a mapping advised for huge pages (where
  the kernel has transparent huge pages), alive as long as a tensor made from it; ordinary memory is not.
- option.row_kernel's copies (kernels/cpu/row_kernel.py) all live in one such mapping and still give oneDNN's bits.
"""

from __future__ import annotations

import gc
import mmap
import os

import pytest
import torch

from lmi_serve.kernels.cpu import huge_pages, row_kernel
from lmi_serve.kernels.host import onednn_available
from lmi_serve.kernels.layers.linear_kernels import OneDnnLinear, use_linear_kernel

from test_linear_kernels import tiny_llama

THP = hasattr(mmap, "MADV_HUGEPAGE") and os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")


def test_floats_are_aligned_writable_and_outlive_their_maker():
    tensor = huge_pages.floats(3 * huge_pages.HUGE_PAGE // 4 + 5)
    assert tensor.dtype == torch.float32 and tensor.shape == (3 * huge_pages.HUGE_PAGE // 4 + 5,)
    assert tensor.data_ptr() % huge_pages.HUGE_PAGE == 0
    view = tensor[7:19]
    del tensor
    gc.collect()
    view.copy_(torch.arange(12.0))  # the mapping is still there: the view holds it
    assert torch.equal(view, torch.arange(12.0))


@pytest.mark.skipif(not THP, reason="this kernel has no transparent huge pages to advise")
def test_floats_are_advised_for_huge_pages_and_ordinary_tensors_are_not():
    assert huge_pages.advised(huge_pages.floats(1000))
    assert not huge_pages.advised(torch.ones(1000))


@pytest.mark.skipif(not THP or not onednn_available() or row_kernel.kernel() is None,
                    reason="no transparent huge pages, oneDNN or row kernel here")
def test_the_row_kernels_copies_share_one_advised_mapping_and_keep_the_bits():
    model = tiny_llama(tied=False)
    use_linear_kernel(model, "onednn", torch.device("cpu"), row_kernel="on")
    layers = [m for m in model.modules() if type(m) is OneDnnLinear and m._row_weights is not None]
    assert len(layers) == 4 * 2 + 1
    addresses = sorted(m._row_weights.weights.data_ptr() for m in layers)
    assert addresses[0] % huge_pages.HUGE_PAGE == 0
    assert all(huge_pages.advised(m._row_weights.weights) for m in layers)
    ends = sorted((m._row_weights.weights.data_ptr(), m._row_weights.weights.numel() * 4) for m in layers)
    assert all(start + size == following for (start, size), (following, _) in zip(ends, ends[1:]))  # one arena
    x = torch.randn(3, layers[0].in_features)
    with torch.no_grad():
        assert torch.equal(layers[0](x), layers[0].batched(torch.cat([x, x]))[:3])
