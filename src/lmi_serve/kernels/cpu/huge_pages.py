"""fp32 storage on transparent huge pages, for weights a kernel streams every step (kernels/cpu/row_kernel.py).

A one-row decode step reads every weight once, a page after a page: with 4 KiB pages that is a TLB miss per
4 KiB. Linux backs an anonymous mapping with 2 MiB pages where it is advised to (`MADV_HUGEPAGE`; the usual
`madvise` setting of /sys/kernel/mm/transparent_hugepage/enabled does nothing unasked, and torch's allocator
does not ask). Measured on a 2-core EPYC (benchmarks/journal/2026-11.md): the row kernel reads SmolLM2's lm_head copy
at 35.5 GB/s from huge pages against 31.3 from 4 KiB ones.

`floats(count)` maps count floats (rounded up to whole 2 MiB pages, the start aligned to one) and advises the
kernel to back it with huge pages; where the platform has no such advice, or the kernel declines, the memory is
the same ordinary memory and only the speed differs. The mapping lives as long as any tensor made from it.
"""

from __future__ import annotations

import logging
import mmap

import numpy as np
import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only


def floats(count: int) -> torch.Tensor:
    """An uninitialised fp32 tensor [count] whose storage starts on a 2 MiB boundary of an anonymous mapping
    advised for huge pages (module docstring)."""
    size = -(-max(count, 1) * 4 // HUGE_PAGE) * HUGE_PAGE
    mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = np.frombuffer(mapping, dtype=np.uint8, count=1).ctypes.data
    offset = -start % HUGE_PAGE
    if _ADVICE is not None:
        try:
            mapping.madvise(_ADVICE, offset, size)
        except OSError as error:  # a kernel without transparent huge pages: ordinary pages
            log.debug("huge pages not advised: %s", error)
    # numpy's view keeps the mapping alive, torch's keeps numpy's
    return torch.from_numpy(np.frombuffer(mapping, dtype=np.float32, count=count, offset=offset))


def advised(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s first byte lies in a mapping advised for huge pages (/proc/self/smaps' `hg` flag)."""
    address = tensor.data_ptr()
    try:
        with open("/proc/self/smaps") as smaps:
            inside = False
            for line in smaps:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    low, high = (int(part, 16) for part in head.split("-"))
                    inside = low <= address < high
                elif inside and head == "VmFlags:":
                    return "hg" in line.split()[1:]
    except OSError:
        return False
    return False
