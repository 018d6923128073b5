"""The CPU's instruction-set flags, read in one place, and the C++ kernel variant they allow.

:func:`cpu_flags` reads the ``flags`` line of ``/proc/cpuinfo`` (Linux; names as the kernel
spells them: ``avx2``, ``avx512f``, ``avx512_bf16``, ``amx_int8`` ...). Where that file is
missing it falls back to ``torch.backends.cpu.get_cpu_capability()`` ("AVX512", "AVX2", ...),
which only tells the AVX level. :func:`cpu_kernel_variant` maps the flags to the build of the C++
CPU kernels (:mod:`pagedllm.ops`) that runs on this CPU:

- ``avx512``: AVX-512 F/BW/VL/DQ with FMA and F16C (Skylake-SP and later Xeons, Zen 4 and later)
- ``avx2``: AVX2 with FMA and F16C (Haswell and later, Zen)
- ``scalar``: anything else (plain C++ loops; also non-x86 CPUs)

The variant is chosen at run time from the CPU that runs the process, never from the machine
that built a cache, so a build cache shared between CPU kinds stays correct.

Note: ``import platform`` inside pagedllm still means the standard library (absolute imports);
this module is ``pagedllm.platform``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = [
    "KERNEL_VARIANTS",
    "VARIANT_REQUIRED_FLAGS",
    "CpuFlags",
    "AUTO_DTYPE_ENV",
    "auto_dtype_name",
    "cpu_flags",
    "cpu_kernel_variant",
    "missing_flags",
    "parse_cpuinfo",
]

# Best first. The flags each variant's code needs (the compiler flags are in pagedllm.ops.loader).
KERNEL_VARIANTS: tuple[str, ...] = ("avx512", "avx2", "scalar")
VARIANT_REQUIRED_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"),
    "avx2": ("avx2", "fma", "f16c"),
    "scalar": (),
}


@dataclass(frozen=True)
class CpuFlags:
    """Instruction-set extensions of the CPU (``True`` when present).

    ``source`` says where they were read: ``"/proc/cpuinfo"``, ``"torch"`` (only the AVX level
    is known then) or ``"cpuinfo text"`` (:func:`parse_cpuinfo` on a given string).
    """

    avx2: bool = False
    fma: bool = False
    f16c: bool = False
    avx512f: bool = False
    avx512bw: bool = False
    avx512vl: bool = False
    avx512dq: bool = False
    avx512_bf16: bool = False
    avx512_vnni: bool = False
    avx_vnni: bool = False
    amx_bf16: bool = False
    amx_int8: bool = False
    source: str = "unknown"
    all_flags: frozenset[str] = field(default_factory=frozenset, repr=False)

    def has(self, name: str) -> bool:
        """Whether flag ``name`` (cpuinfo spelling) is present."""
        value = getattr(self, name, None)
        if isinstance(value, bool):
            return value
        return name in self.all_flags

    def summary(self) -> str:
        """The known flags that are present, space-separated (for logs)."""
        names = [
            "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
            "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8",
        ]  # fmt: skip
        present = [n for n in names if getattr(self, n)]
        return " ".join(present) if present else "none of avx2/avx512/amx"


_FIELDS = (
    "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
    "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8",
)  # fmt: skip


def _from_names(names: Iterable[str], source: str) -> CpuFlags:
    present = frozenset(n.strip().lower() for n in names if n.strip())
    return CpuFlags(
        **{f: f in present for f in _FIELDS},  # type: ignore[arg-type]
        source=source,
        all_flags=present,
    )


def parse_cpuinfo(text: str, source: str = "cpuinfo text") -> CpuFlags:
    """Flags from the text of ``/proc/cpuinfo``: the first ``flags`` line (x86) or
    ``Features`` line (ARM); all flags ``False`` when there is none."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return _from_names(value.split(), source)
    return _from_names((), source)


def _from_torch_capability() -> CpuFlags:
    """Flags implied by ``torch.backends.cpu.get_cpu_capability()`` (AVX level only)."""
    try:
        import torch

        cap = str(torch.backends.cpu.get_cpu_capability()).upper()
    except Exception:  # noqa: BLE001 - no torch or an old one: nothing known
        cap = ""
    names: list[str] = []
    if cap.startswith("AVX512"):
        names += ["avx512f", "avx512bw", "avx512vl", "avx512dq"]
    if cap.startswith(("AVX2", "AVX512")):
        names += ["avx2", "fma", "f16c"]  # ATen's AVX2 level requires FMA as well
    return _from_names(names, "torch")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> CpuFlags:
    """This CPU's flags (read once per process)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = parse_cpuinfo(f.read(), source="/proc/cpuinfo")
        if flags.all_flags:
            return flags
    except OSError:
        pass
    return _from_torch_capability()


def missing_flags(variant: str, flags: CpuFlags | None = None) -> list[str]:
    """The CPU flags that ``variant`` needs and ``flags`` (default: this CPU) lacks."""
    if variant not in VARIANT_REQUIRED_FLAGS:
        raise ValueError(f"unknown CPU kernel variant {variant!r}; one of {KERNEL_VARIANTS}")
    flags = cpu_flags() if flags is None else flags
    return [n for n in VARIANT_REQUIRED_FLAGS[variant] if not flags.has(n)]


def cpu_kernel_variant(flags: CpuFlags | None = None) -> str:
    """The best C++ kernel variant (``avx512``, ``avx2`` or ``scalar``) that ``flags`` (default:
    this CPU) can run."""
    flags = cpu_flags() if flags is None else flags
    for variant in KERNEL_VARIANTS:
        if not missing_flags(variant, flags):
            return variant
    return "scalar"


# Why: the rule behind dtype="auto" (figures in docs/dtype.md). bf16 pays only where the CPU has
# bf16 matrix hardware that beats its fp32 FMAs: AMX tiles (measured: pagedllm 1098 vs 477 tok/s,
# bf16 vs fp32, on an AMX Xeon) and AVX512-BF16 dot products (measured on AMD Zen 4: 1.6x fp32 at
# batch 64, 1.2x at batch 1). On AVX2 CPUs bf16 matmuls are emulated and 2-4x slower than fp32
# (measured on Zen 3).
AUTO_DTYPE_ENV = "PAGEDLLM_AUTO_DTYPE"


def auto_dtype_name(
    device: str = "cpu", flags: CpuFlags | None = None, quantization: str | None = None
) -> str:
    """The dtype that ``dtype="auto"`` means on ``device`` (``"float32"`` or ``"bfloat16"``).

    Rule: CUDA -> bfloat16; a CPU with GGUF weights kept quantized (``quantization`` gguf) ->
    float32 (with bf16 activations the bundled Q4_1 model decoded 2-4x slower at batch 1 on
    Zen 4 and Zen 5); a CPU with AMX-BF16 tiles or AVX512-BF16 dot products -> bfloat16, int8
    W8A8 weights included (their layers run in the fused op either way, while the LM head, the
    attention and the KV cache gain from bf16: 1.15-1.3x fp32's speed on Zen 5 at the same
    perplexity, docs/dtype.md); any other CPU -> float32.
    The environment variable ``PAGEDLLM_AUTO_DTYPE`` (a dtype name) overrides the rule; the test
    suite sets it to float32 so that its exactness checks do not depend on the CPU kind.

    Args:
        device: ``"cpu"`` or ``"cuda[:N]"``.
        flags: the CPU's flags (default: this CPU's, :func:`cpu_flags`).
        quantization: the engine's ``quantization`` (None: weights in the model dtype).
    """
    import os

    override = os.environ.get(AUTO_DTYPE_ENV)
    if override:
        return override
    if device.startswith("cuda"):
        return "bfloat16"
    if quantization == "gguf":
        return "float32"
    flags = cpu_flags() if flags is None else flags
    return "bfloat16" if flags.amx_bf16 or flags.avx512_bf16 else "float32"
