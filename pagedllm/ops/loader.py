"""Build (first use) and load the C++ CPU kernels, one ISA variant per process.

Sources: ``pagedllm/csrc/cpu/`` (``*.cpp``, ``*.h``), shipped inside the package as package
data, so an installed pagedllm (wheel, sdist, ``pip install .``) builds them exactly like a
checkout. ``torch_bindings.cpp`` registers the ops with PyTorch's dispatcher as
``torch.ops.pagedllm.<name>``; :class:`pagedllm.ops.CpuOps` is the typed Python face.

Variants: the same sources are compiled with explicit instruction-set flags, never
``-march=native``:

- ``avx512``: ``-mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512dq``
- ``avx2``: ``-mavx2 -mfma -mf16c`` (and ``-mno-avx512f``)
- ``scalar``: no SIMD (``-mno-avx`` on x86): plain C++ loops, for any CPU

``pagedllm.platform.cpu_kernel_variant()`` picks the best one the running CPU supports, so a build
cache made on one kind of CPU is correct on another: each variant has its own build.

Builds: JIT with ``torch.utils.cpp_extension.load`` (ninja, ``-O3 -fopenmp``) on first use, into
``<root>/pagedllm_cpu_<variant>_<hash>/``; the hash covers the source files' names and contents,
the compiler flags, the variant, the compiler command, the torch version and the folder torch is
installed in (its headers' paths are in ninja's compile commands; not where the sources are, nor the
build host). The sources are copied into that directory (``src/``) and compiled from
there: ninja records absolute source and include paths, so compiling them where they lie would make
two checkouts sharing one cache rebuild each other's build. From the copy, identical sources
anywhere (another checkout, a git worktree, an installed wheel) share one build.
``<root>`` is the first writable of ``$PAGEDLLM_KERNEL_CACHE_DIR``,
``$PAGEDLLM_CACHE_DIR/torch_extensions`` (default ``$XDG_CACHE_HOME/pagedllm`` or
``~/.cache/pagedllm``, the directory of the tokenizer cache) and
``<tmp>/pagedllm-<uid>/torch_extensions``. A first build takes about 1-2 minutes, a cached load
well under a second. Concurrent processes share one build (torch's lock file in the directory,
wrapped in :func:`pagedllm.ops.build_lock.exclusive_build`, which removes a lock left by a killed
build and bounds the wait for a running one).

If the sources are missing, no compiler is found, the CPU cannot run the requested variant, or
the build fails, :func:`load_cpu_ops` returns ``None`` after one warning and callers use the
PyTorch path.

Environment:
    PAGEDLLM_DISABLE_CPU_KERNELS=1: never build; always fall back.
    PAGEDLLM_CPU_KERNEL_VARIANT: ``auto`` (default), ``avx512``, ``avx2`` or ``scalar``; a variant
        the CPU cannot run is refused (fallback with a warning naming the missing CPU flags).
    PAGEDLLM_CPU_ARCH_FLAGS: replaces the variant's instruction-set flags (e.g. ``-march=native``
        for the former behaviour); part of the build hash.
    PAGEDLLM_ATTENTION_BF16_DOT=0 (or false / no / off, :func:`env_turns_off`): the attention
        kernels keep fp32 arithmetic on bf16 KV caches (:meth:`CpuOps.attention_bf16_dot`; on by
        default where the CPU has avx512_bf16, except Intel CPUs without AMX tiles).
    PAGEDLLM_GEMM_AMX=0 (or false / no / off): bf16 GEMM panels run on vdpbf16ps instead of AMX
        tiles (:meth:`CpuOps.gemm_amx`; on by default where the CPU has amx_bf16).
    PAGEDLLM_ATTENTION_AMX=0 (or false / no / off): the bf16 attention dot products (scores and
        p . V) run on vdpbf16ps instead of AMX tiles (:meth:`CpuOps.attention_amx`; on by
        default where the CPU has amx_bf16).
    PAGEDLLM_GEMM_BF16_FMA=0 (or false / no / off): bf16 GEMM panels outside AMX tiles run on
        vdpbf16ps instead of fp32 FMAs on widened weights (:meth:`CpuOps.gemm_bf16_fma`; on by
        default on Intel CPUs).
    PAGEDLLM_GGUF_ISA=avx2|avx_vnni: the GGUF kernels run their 8-row AVX2 (maddubs) or
        AVX-VNNI (VEX vpdpbusd) loops, not the AVX512-VNNI ones nor the 16-row records;
        PAGEDLLM_INT8_ISA=avx_vnni|avx2|scalar: the int8 GEMM's lower inner loops. Both for tests
        on one CPU (a path the CPU lacks is ignored); another value leaves the best path on, with
        a warning. PAGEDLLM_INT8_ISA=amx_int8: the int8 GEMM on AMX tiles (TDPBUSD), where the
        CPU has amx_int8; not the default until measured against avx512_vnni on such a CPU.
    PAGEDLLM_KERNEL_CACHE_DIR: the build root, overriding ``$PAGEDLLM_CACHE_DIR/torch_extensions``.
    PAGEDLLM_KERNEL_BUILD_TIMEOUT: seconds to wait for another process's build (default 1800);
        past it the loader falls back with a warning naming the lock file.
    CXX: the C++ compiler (default ``c++``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform as _std_platform
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm.ops.build_lock import exclusive_build
from pagedllm.ops.cpu_ops import CpuOps
from pagedllm.platform import (
    KERNEL_VARIANTS,
    cpu_flags,
    cpu_kernel_variant,
    missing_flags,
)

logger = logging.getLogger(__name__)

SRC_DIR = Path(__file__).resolve().parents[1] / "csrc" / "cpu"
SOURCES = (
    "paged_attention.cpp", "prefill_attention.cpp", "attention_bf16.cpp", "attention_amx.cpp",
    "kv_cache_ops.cpp", "layer_ops.cpp", "gemm.cpp", "gemm_amx.cpp", "quant_gguf.cpp",
    "int8_gemm.cpp", "fused_layer.cpp", "torch_bindings.cpp",
)  # fmt: skip
HEADERS = (
    "vec.h", "kv_quant.h", "attention_common.h", "attention_bf16.h", "attention_amx.h",
    "amx_tiles.h", "paged_attention.h", "layer_ops.h", "gemm.h", "gemm_amx.h", "gemm_amx_blocks.h",
    "quant_gguf.h", "quant_gguf_512.h", "int8_gemm.h", "int8_rows.h", "fused_layer.h",
)  # fmt: skip

_X86 = _std_platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")

# Instruction-set flags per variant (the optimisation and OpenMP flags are common, see _cflags).
VARIANT_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512": (
        "-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
    ),
    "avx2": ("-mavx2", "-mfma", "-mf16c", "-mno-avx512f"),
    "scalar": ("-mno-avx",) if _X86 else (),
}  # fmt: skip
_COMMON_CFLAGS = ("-O3", "-fopenmp", "-DNDEBUG")


@dataclass(frozen=True)
class KernelBuild:
    """What :func:`load_cpu_ops` loaded: the variant, its compiler flags, where the build lives
    and how long the load took (compile or cache hit)."""

    variant: str
    simd_level: str
    cflags: tuple[str, ...]
    build_dir: Path
    library: Path
    seconds: float


_lock = threading.Lock()
_ops: CpuOps | None = None
_build: KernelBuild | None = None
_load_error: str | None = None
_tried = False


def requested_variant() -> str:
    """The variant to load: ``$PAGEDLLM_CPU_KERNEL_VARIANT`` when set (not ``auto``), else the
    best one this CPU supports."""
    forced = os.environ.get("PAGEDLLM_CPU_KERNEL_VARIANT", "").strip().lower()
    if forced and forced != "auto":
        if forced not in KERNEL_VARIANTS:
            raise ValueError(
                f"PAGEDLLM_CPU_KERNEL_VARIANT={forced!r}: expected auto or one of "
                f"{', '.join(KERNEL_VARIANTS)}"
            )
        return forced
    return cpu_kernel_variant()


def isa_flags(variant: str) -> tuple[str, ...]:
    """The instruction-set compiler flags of ``variant`` (``$PAGEDLLM_CPU_ARCH_FLAGS`` wins)."""
    override = os.environ.get("PAGEDLLM_CPU_ARCH_FLAGS")
    if override is not None and override.strip():
        return tuple(override.split())
    return VARIANT_FLAGS[variant]


def _cflags(variant: str) -> tuple[str, ...]:
    return (*_COMMON_CFLAGS, *isa_flags(variant))


def _cxx() -> str:
    return os.environ.get("CXX", "c++")


def cache_root() -> Path:
    """The preferred build root (see the module docstring); may not exist yet."""
    explicit = os.environ.get("PAGEDLLM_KERNEL_CACHE_DIR")
    if explicit:
        return Path(explicit)
    # Same resolution as pagedllm.model.loader.tokenizer.tokenizer_cache_dir.
    root = os.environ.get("PAGEDLLM_CACHE_DIR") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedllm"
    )
    return Path(root) / "torch_extensions"


def build_key(variant: str) -> str:
    """Hash of what the build depends on: the sources' names and contents (not their directory),
    flags, variant, compiler, torch version and torch's install folder (each environment with its
    own torch has its own build, instead of ninja recompiling one build for the other's headers)."""
    h = hashlib.sha1()
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode() + b"\0" + (SRC_DIR / name).read_bytes() + b"\0")
    torch_dir = str(Path(torch.__file__).resolve().parent)
    h.update(" ".join((variant, *_cflags(variant), _cxx(), torch.__version__)).encode())
    h.update(b"\0" + torch_dir.encode())
    return h.hexdigest()[:12]


def build_dir(variant: str) -> Path:
    """The (created, writable) directory of ``variant``'s build."""
    name = f"pagedllm_cpu_{variant}_{build_key(variant)}"
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    roots = [cache_root(), Path(tempfile.gettempdir()) / f"pagedllm-{uid}" / "torch_extensions"]
    for root in roots:
        try:
            path = root / name
            path.mkdir(parents=True, exist_ok=True)
            if os.access(path, os.W_OK):
                return path
        except OSError:
            continue
    raise OSError(f"no writable directory for the CPU kernel build (tried {roots})")


STAGED_SOURCES_DIR = "src"


def stage_sources(directory: Path) -> Path:
    """Copy the kernel sources and headers into ``directory/src`` and return that folder.

    ``directory`` is the content-keyed build directory (:func:`build_dir`), so the compile reads
    its sources from a path that depends only on their contents (see the module docstring). A file
    already there with the same bytes is left alone, its modification time too (ninja would
    rebuild otherwise); any other is written to a temporary name and renamed into place, so a copy
    killed part way never leaves a truncated source. Call it while holding
    :func:`pagedllm.ops.build_lock.exclusive_build` on ``directory``.

    Raises:
        OSError: a source cannot be read or the copy cannot be written.
    """
    staged = directory / STAGED_SOURCES_DIR
    staged.mkdir(exist_ok=True)
    for name in (*SOURCES, *HEADERS):
        data = (SRC_DIR / name).read_bytes()
        target = staged / name
        if target.is_file() and target.read_bytes() == data:
            continue
        partial = staged / f".{name}.{os.getpid()}.partial"
        partial.write_bytes(data)
        os.replace(partial, target)
    return staged


def _check_buildable() -> None:
    missing = [n for n in (*SOURCES, *HEADERS) if not (SRC_DIR / n).is_file()]
    if missing:
        raise FileNotFoundError(f"kernel sources {missing} not found under {SRC_DIR}")
    if shutil.which(_cxx()) is None:
        raise RuntimeError(f"no C++ compiler ({_cxx()}) on PATH")


_OFF_WORDS = ("0", "false", "no", "off")
# Default-on kernel features and the CpuOps switch each environment variable turns off.
_KERNEL_SWITCHES = (
    ("PAGEDLLM_ATTENTION_BF16_DOT", "attention_bf16_dot"),
    ("PAGEDLLM_GEMM_AMX", "gemm_amx"),
    ("PAGEDLLM_ATTENTION_AMX", "attention_amx"),
    ("PAGEDLLM_GEMM_BF16_FMA", "gemm_bf16_fma"),
)


def env_turns_off(name: str) -> bool:
    """Whether environment variable ``name`` turns a default-on kernel feature off: ``0``,
    ``false``, ``no`` or ``off`` (any case, surrounding blanks ignored). Unset or empty leaves it
    on; any other value too, with a warning naming the variable."""
    value = os.environ.get(name, "").strip().lower()
    if value in _OFF_WORDS:
        return True
    if value not in ("", "1", "true", "yes", "on"):
        logger.warning(
            "%s=%r is not a switch value (0/1, false/true, no/yes, off/on); left on",
            name,
            os.environ[name],
        )
    return False


# Values the kernels' own instruction-set overrides take (read by the C++ code, once).
_ISA_OVERRIDES = {
    "PAGEDLLM_GGUF_ISA": ("auto", "avx2", "avx_vnni"),
    "PAGEDLLM_INT8_ISA": ("auto", "amx_int8", "avx_vnni", "avx2", "scalar"),
}


def warn_unknown_isa_overrides() -> None:
    """Warn about a ``PAGEDLLM_GGUF_ISA`` / ``PAGEDLLM_INT8_ISA`` value the kernels ignore (they
    compare exactly: "AVX2" or " avx2" leaves the best path on)."""
    for name, values in _ISA_OVERRIDES.items():
        value = os.environ.get(name)
        if value is not None and value not in values and value != "":
            logger.warning(
                "%s=%r is not one of %s (exact, lower case); the best path stays on",
                name,
                value,
                ", ".join(values),
            )


def load_cpu_ops(verbose: bool = False) -> CpuOps | None:
    """Build (first time) or load this CPU's kernel variant and return its typed ops; ``None``
    (after one warning) when that is impossible. Later calls return the same object."""
    global _ops, _build, _load_error, _tried
    with _lock:
        if _tried:
            return _ops
        _tried = True
        if os.environ.get("PAGEDLLM_DISABLE_CPU_KERNELS") == "1":
            _load_error = "disabled by PAGEDLLM_DISABLE_CPU_KERNELS=1"
            return None
        try:
            variant = requested_variant()
            lacking = missing_flags(variant)
            if lacking:
                raise RuntimeError(
                    f"the CPU cannot run kernel variant {variant!r} (missing CPU flags: "
                    f"{' '.join(lacking)})"
                )
            _check_buildable()
            from torch.utils.cpp_extension import load

            t0 = time.perf_counter()
            directory = build_dir(variant)
            with exclusive_build(directory):  # clears a lock left by a killed build
                staged = stage_sources(directory)
                library = load(
                    name=f"pagedllm_cpu_{variant}",
                    sources=[str(staged / n) for n in SOURCES],
                    extra_include_paths=[str(staged)],
                    extra_cflags=list(_cflags(variant)),
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(directory),
                    verbose=verbose,
                    is_python_module=False,  # torch.ops.load_library: registers torch.ops.pagedllm
                )
            ops = CpuOps(variant)
            warn_unknown_isa_overrides()
            for variable, switch in _KERNEL_SWITCHES:
                if env_turns_off(variable):
                    getattr(ops, switch)(False)
            seconds = time.perf_counter() - t0
            _build = KernelBuild(
                variant=variant,
                simd_level=ops.simd_level(),
                cflags=_cflags(variant),
                build_dir=directory,
                library=Path(str(library)),
                seconds=seconds,
            )
            _ops = ops
            override = os.environ.get("PAGEDLLM_CPU_ARCH_FLAGS", "").strip()
            logger.info(
                "pagedllm C++ CPU kernels: variant %s (cpu flags: %s)%s, bf16 attention dot "
                "products %s (on AMX tiles %s), AMX bf16 GEMM %s, bf16 GEMM panels on %s, "
                "ready in %.1f s from %s",
                variant,
                cpu_flags().summary(),
                f", simd {_build.simd_level} from PAGEDLLM_CPU_ARCH_FLAGS={override!r}"
                if override
                else "",
                "on" if ops.attention_bf16_dot() else "off",
                "on" if ops.attention_amx() else "off",
                "on" if ops.gemm_amx() else "off",
                "fp32 FMAs" if ops.gemm_bf16_fma() else "vdpbf16ps",
                seconds,
                directory,
            )
        except Exception as e:  # noqa: BLE001 - any build problem means "fall back"
            _ops = None
            _load_error = f"{type(e).__name__}: {e}"
            warnings.warn(
                "pagedllm: could not build the C++ CPU kernels; falling back to the PyTorch "
                f"path ({_load_error})",
                RuntimeWarning,
                stacklevel=2,
            )
        return _ops


def cpu_ops_available() -> bool:
    """Whether the C++ kernels load (builds them on first call)."""
    return load_cpu_ops() is not None


def cpu_ops_error() -> str | None:
    """Why the kernels are unavailable (``None`` if they loaded or were never tried)."""
    return _load_error


def kernel_build() -> KernelBuild | None:
    """The loaded build (``None`` before a successful :func:`load_cpu_ops`)."""
    return _build


def compile_check(variant: str, out_dir: str | os.PathLike[str]) -> list[Path]:
    """Compile every source of ``variant`` to an object file in ``out_dir`` (``-O0``, no link,
    nothing loaded), so a variant this CPU cannot run can still be checked to build. The sources
    compile in parallel, one compiler per core (the torch bindings alone take most of the time).

    An object's name carries a hash of everything its compile depends on (:func:`build_key`:
    the sources' contents, compiler, torch version; plus this check's flags), and an object
    already in ``out_dir`` under that name is not compiled again: pass a lasting folder (such as
    one under :func:`cache_root`) to check the same sources once. Objects are written to a
    temporary name and renamed, so a killed compile leaves none behind.

    Returns the object files in ``SOURCES`` order; raises ``subprocess.CalledProcessError`` (with
    the compiler's output) on an error."""
    from concurrent.futures import ThreadPoolExecutor

    from torch.utils.cpp_extension import include_paths

    _check_buildable()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    flags = ("-std=c++20", "-fPIC", "-O0", "-fopenmp", *isa_flags(variant))
    tag = hashlib.sha1(" ".join((build_key(variant), *flags)).encode()).hexdigest()[:12]
    includes = [f"-I{p}" for p in (str(SRC_DIR), *include_paths())]

    def compile_one(name: str) -> Path:
        obj = out / f"{variant}_{Path(name).stem}_{tag}.o"
        if obj.is_file() and obj.stat().st_size > 0:
            return obj  # these very sources, flags and compiler compiled before
        partial = obj.with_name(f".{obj.name}.{os.getpid()}.partial")
        cmd = [_cxx(), *flags, *includes, "-c", str(SRC_DIR / name), "-o", str(partial)]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            os.replace(partial, obj)
        finally:
            partial.unlink(missing_ok=True)
        return obj

    workers = max(1, min(len(SOURCES), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(compile_one, SOURCES))
