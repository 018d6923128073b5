"""Keep freed heap memory mapped, so a step's large temporaries stop page-faulting every step.

Each engine step allocates and frees buffers of a few MiB to a few tens of MiB: the logits
(``[batch, vocab]`` fp32: 12.6 MB at batch 64 for a 49,152-token vocabulary), the activations
of a prefill chunk, dtype conversions. glibc serves such sizes with ``mmap`` and unmaps them on
``free`` (or trims the heap top back to the OS), so the next step faults every page in again and
the kernel zeroes it: with PyTorch's huge-page allocations (``THP_MEM_ALLOC_ENABLE``, set by
``import pagedllm``) that was ~6% of a bf16 batch-64 workload in ``clear_page_erms`` on a 2-core
Zen 4, and the workload ran at 496-502 output tok/s against 587-625 with the thresholds below
(workload a of ``benchmarks/vs_vllm.py``, pagedllm alone; docs/benchmarks.md). vLLM's CPU guide
reaches the same end by preloading tcmalloc.

:func:`keep_freed_memory` raises glibc's mmap threshold to its maximum (32 MiB: larger buffers,
such as the KV cache, still get their own mapping) and its trim threshold to the largest value
``mallopt`` takes, so freed memory below 32 MiB stays in the heap for the next step. The cost is
that the process keeps its peak heap. Only stdlib here: importing this module (``import
pagedllm`` does, before torch loads) calls it once and records the result in ``malloc_tuned``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1  # <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD_BYTES = 2**31 - 1  # mallopt takes an int: in effect, never trim the heap top
DISABLE_ENV = "PAGEDLLM_DISABLE_MALLOC_TUNING"
# A user's own malloc settings win: the environment variables glibc reads at start-up.
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_USER_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")


def keep_freed_memory(environ: dict[str, str] | None = None) -> bool:
    """Set glibc's mmap threshold to 32 MiB and its trim threshold to 2 GiB - 1 (``mallopt``)
    for this process.

    Skipped (returns False) when ``PAGEDLLM_DISABLE_MALLOC_TUNING=1``, when the user set either
    threshold (``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` or the matching
    ``GLIBC_TUNABLES``), off Linux, or when the C library has no ``mallopt`` (musl). Never
    raises.

    Args:
        environ: the environment to read (default ``os.environ``).

    Returns:
        True when both thresholds were set.
    """
    env = os.environ if environ is None else environ
    if env.get(DISABLE_ENV, "0") not in ("", "0") or not sys.platform.startswith("linux"):
        return False
    if any(k in env for k in _USER_SETTINGS):
        return False
    if any(t in env.get("GLIBC_TUNABLES", "") for t in _USER_TUNABLES):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success; the mmap threshold first, as it also stops glibc's own
    # dynamic adjustment of both thresholds.
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


# Applied on import (``import pagedllm`` imports this module before torch loads).
malloc_tuned = keep_freed_memory()
