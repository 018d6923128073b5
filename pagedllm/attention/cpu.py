"""PagedAttention CPU kernels (C++ / OpenMP / AVX-512 or AVX2) behind the backend interface.

The extension in ``pagedllm/csrc/cpu/`` is compiled on first use with ``torch.utils.cpp_extension.load``
(``-O3 -march=native -fopenmp``) into ``build/torch_extensions/`` next to the sources (or
``~/.cache/pagedllm/torch_extensions`` when that is not writable) and reused afterwards: torch
rebuilds only when the sources or flags change. The build directory name includes a hash of the
CPU's instruction-set flags, so a cache copied to another kind of CPU is not reused there.

If the sources are missing, no compiler is found, or the build fails, ``load_cpu_ops`` returns
``None`` after one warning and ``CpuPagedAttention`` runs ``TorchNativeAttention`` instead.

Environment:
    PAGEDLLM_CPU_ARCH_FLAGS: replaces ``-march=native`` (e.g. ``-march=x86-64`` for the scalar
        path, ``-mavx2 -mfma`` for AVX2 only).
    PAGEDLLM_DISABLE_CPU_KERNELS=1: never build; always fall back.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_native import TorchNativeAttention

logger = logging.getLogger(__name__)

_REPO_ROOT = Path(__file__).resolve().parents[2]
_SRC_DIR = Path(__file__).resolve().parents[1] / "csrc" / "cpu"
_SOURCES = [_SRC_DIR / "paged_attention.cpp", _SRC_DIR / "layer_ops.cpp", _SRC_DIR / "gemm.cpp"]
_HEADERS = [_SRC_DIR / "vec.h", _SRC_DIR / "layer_ops.h", _SRC_DIR / "gemm.h"]

_lock = threading.Lock()
_ops: ModuleType | None = None
_load_error: str | None = None
_tried = False
build_seconds: float | None = None  # wall time of the last load (compile or cache hit)


def _arch_flags() -> list[str]:
    return os.environ.get("PAGEDLLM_CPU_ARCH_FLAGS", "-march=native").split()


def _cpu_fingerprint() -> str:
    """Hash of the CPU flags (so a -march=native build is tied to the CPU kind) and build flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = line
                    break
    except OSError:
        pass
    key = flags + " ".join(_arch_flags()) + torch.__version__
    return hashlib.sha1(key.encode()).hexdigest()[:10]


def _build_dir() -> Path:
    name = f"pagedllm_cpu_{_cpu_fingerprint()}"
    for root in (
        _REPO_ROOT / "build" / "torch_extensions",
        Path.home() / ".cache" / "pagedllm" / "torch_extensions",
    ):
        try:
            path = root / name
            path.mkdir(parents=True, exist_ok=True)
            if os.access(path, os.W_OK):
                return path
        except OSError:
            continue
    raise OSError("no writable directory for the CPU extension build")


def load_cpu_ops(verbose: bool = False) -> ModuleType | None:
    """Build (first time) or load the C++ extension; ``None`` (with one warning) if impossible."""
    global _ops, _load_error, _tried, build_seconds
    with _lock:
        if _tried:
            return _ops
        _tried = True
        if os.environ.get("PAGEDLLM_DISABLE_CPU_KERNELS") == "1":
            _load_error = "disabled by PAGEDLLM_DISABLE_CPU_KERNELS=1"
            return None
        try:
            if not all(p.exists() for p in _SOURCES + _HEADERS):
                raise FileNotFoundError(f"kernel sources not found under {_SRC_DIR}")
            cxx = os.environ.get("CXX", "c++")
            if shutil.which(cxx) is None:
                raise RuntimeError(f"no C++ compiler ({cxx}) on PATH")
            from torch.utils.cpp_extension import load

            t0 = time.perf_counter()
            _ops = load(
                name="pagedllm_cpu_kernels",
                sources=[str(p) for p in _SOURCES],
                extra_include_paths=[str(_SRC_DIR)],
                extra_cflags=["-O3", *_arch_flags(), "-fopenmp", "-DNDEBUG"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(_build_dir()),
                verbose=verbose,
            )
            build_seconds = time.perf_counter() - t0
            logger.info(
                "CPU attention kernels (%s) ready in %.1f s", _ops.simd_level(), build_seconds
            )
        except Exception as e:  # noqa: BLE001 - any build problem means "fall back"
            _ops = None
            _load_error = f"{type(e).__name__}: {e}"
            warnings.warn(
                "pagedllm: could not build the C++ CPU attention kernels; falling back to "
                f"torch_native attention ({_load_error})",
                RuntimeWarning,
                stacklevel=2,
            )
        return _ops


def cpu_ops_available() -> bool:
    return load_cpu_ops() is not None


def cpu_ops_error() -> str | None:
    """Why the extension is unavailable (``None`` if it loaded or was never tried)."""
    return _load_error


class CpuPagedAttention:
    """Paged attention on the C++ CPU kernels; falls back to ``TorchNativeAttention`` when the
    extension is unavailable or the tensors are not float32 / bfloat16 CPU tensors.

    Decodes (the first ``meta.num_decodes`` sequences) go to ``paged_attention_decode``, the
    multi-token sequences to ``paged_attention_prefill``; both read K/V in place through the block
    tables. ``partition_size``: context length per partition when a long decode context is split
    across threads (flash-decoding); 0 disables splitting.
    """

    name = "cpu"

    def __init__(self, partition_size: int = 512) -> None:
        self.partition_size = partition_size
        self.ops = load_cpu_ops()
        self._fallback = TorchNativeAttention()

    @property
    def is_native(self) -> bool:
        """True when the C++ kernels are in use."""
        return self.ops is not None

    @staticmethod
    def _plan(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Once per step: int64 contiguous block tables, seq lens and query starts."""
        plan = meta.backend_cache.get("cpu")
        if plan is None:
            plan = (
                meta.block_tables.to(torch.int64).contiguous(),
                meta.seq_lens.to(torch.int64).contiguous(),
                meta.query_start_loc.to(torch.int64).contiguous(),
            )
            meta.backend_cache["cpu"] = plan
        return plan

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write K/V of the new tokens into their slots, then attend (see
        ``reference.paged_attention_reference`` for the contract)."""
        ops = self.ops
        if (
            ops is None
            or query.device.type != "cpu"
            or query.dtype not in (torch.float32, torch.bfloat16)
            or key_cache.dtype != query.dtype
        ):
            return self._fallback.forward(query, key, value, key_cache, value_cache, meta, scale)
        ops.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping)
        if query.stride(-1) != 1:
            query = query.contiguous()
        out = torch.empty_like(query)
        tables, seq_lens, starts = self._plan(meta)
        nd, ns = meta.num_decodes, meta.num_seqs
        if nd:
            ops.paged_attention_decode(
                out,
                query,
                key_cache,
                value_cache,
                tables,
                seq_lens,
                nd,
                scale,
                self.partition_size,
            )
        if nd < ns:
            ops.paged_attention_prefill(
                out, query, key_cache, value_cache, tables, seq_lens, starts, nd, ns, scale
            )
        return out


def copy_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]
) -> None:
    """Copy-on-write for every layer with the C++ kernel (torch index ops when unavailable)."""
    if not pairs:
        return
    mapping = torch.tensor(pairs, dtype=torch.int64).view(-1, 2)
    ops = load_cpu_ops()
    if ops is not None and all(k.device.type == "cpu" for k, _ in kv_caches):
        ops.copy_blocks([k for k, _ in kv_caches], [v for _, v in kv_caches], mapping)
        return
    src, dst = mapping[:, 0], mapping[:, 1]
    for k, v in kv_caches:
        k.index_copy_(1, dst.to(k.device), k.index_select(1, src.to(k.device)))
        v.index_copy_(1, dst.to(v.device), v.index_select(1, src.to(v.device)))


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copy block ``a`` of ``src`` into block ``b`` of ``dst`` for each (a, b) pair."""
    if not pairs:
        return
    mapping = torch.tensor(pairs, dtype=torch.int64).view(-1, 2)
    ops = load_cpu_ops()
    if ops is not None and src.device.type == "cpu" and dst.device.type == "cpu":
        ops.swap_blocks(src, dst, mapping)
        return
    s, d = mapping[:, 0].to(src.device), mapping[:, 1].to(dst.device)
    dst.index_copy_(1, d, src.index_select(1, s).to(dst.device))
