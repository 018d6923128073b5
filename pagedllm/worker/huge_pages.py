"""Transparent huge pages for the big CPU buffers a step streams through (KV cache, weights).

A decode step reads every weight (540 MB fp32 for SmolLM2-135M) and, per KV head, one 4 KiB page
per KV block (``[KVH, num_blocks, block_size, head_dim]``, block size 16 x head_dim 64 x 4 bytes):
with 4 KiB pages nearly every block costs a TLB miss and a page walk. 2 MiB pages cut that 512-fold.
Measured on the 2-core dev machine (``benchmarks/decode_step.py --batch 64``, alternating runs):
step 229 / 213 ms with 4 KiB pages vs 217 / 192 ms with PyTorch's ``THP_MEM_ALLOC_ENABLE=1`` and
200 / 180 ms with glibc's huge-page malloc (docs/benchmarks.md).

``import pagedllm`` sets ``THP_MEM_ALLOC_ENABLE=1`` before torch loads, which makes PyTorch's CPU
allocator align allocations of 2 MiB or more to 2 MiB and ``madvise(MADV_HUGEPAGE)`` them
(weights and oneDNN's packed copies included). ``advise_huge_pages`` does the same for one
buffer, so the KV cache gets huge pages even when the user imported torch first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Any

import torch

HUGE_PAGE = 2 << 20  # bytes (x86-64 and arm64 transparent huge pages)
_MADV_HUGEPAGE = 14  # <linux/mman.h>

_libc = None


def _madvise() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise


def advise_huge_pages(t: torch.Tensor) -> int:
    """Ask the kernel to back the 2 MiB-aligned part of ``t``'s memory with transparent huge
    pages (``madvise(MADV_HUGEPAGE)``). Call it before the memory is first written (e.g. on
    ``torch.empty``) so page faults take huge pages directly.

    Args:
        t: a contiguous CPU tensor of any dtype.

    Returns:
        Bytes advised: 0 when ``t`` is not on the CPU, holds no whole aligned 2 MiB page, the OS
        is not Linux, or the kernel refused (THP off: the call is then a harmless no-op).
    """
    if t.device.type != "cpu" or not sys.platform.startswith("linux") or not t.is_contiguous():
        return 0
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo = -(-start // HUGE_PAGE) * HUGE_PAGE
    hi = end // HUGE_PAGE * HUGE_PAGE
    if hi <= lo:
        return 0
    try:
        if _madvise()(lo, hi - lo, _MADV_HUGEPAGE) != 0:
            return 0
    except (OSError, AttributeError):
        return 0
    return hi - lo


def zeros_huge(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.zeros(shape)``, on the CPU backed by huge pages where the kernel allows
    (``advise_huge_pages`` between allocation and the first write)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype)
    advise_huge_pages(t)
    return t.zero_()
