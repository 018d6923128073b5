"""pagedllm's C++ CPU kernels as dispatcher ops (``torch.ops.pagedllm.<name>``).

``load_cpu_ops()`` builds on first use (or loads from the cache) the kernel variant this CPU
runs best (``avx512``, ``avx2`` or ``scalar``; :func:`pagedllm.platform.cpu_kernel_variant`)
and returns a :class:`CpuOps`, the typed wrapper of the ops, or ``None`` when the kernels cannot
be built (the callers then take the PyTorch path). Where sources and builds live, and the
environment variables: :mod:`pagedllm.ops.loader`.
"""

from pagedllm.ops.cpu_ops import CpuOps
from pagedllm.ops.loader import (
    KernelBuild,
    cpu_ops_available,
    cpu_ops_error,
    kernel_build,
    load_cpu_ops,
)

__all__ = [
    "CpuOps",
    "KernelBuild",
    "cpu_ops_available",
    "cpu_ops_error",
    "kernel_build",
    "load_cpu_ops",
]
