"""Linear layers with weights prepacked once at load time, on the CPU (fp32, and bf16 where the
CPU has bf16 hardware).

Kernels, chosen per process:

- **pagedllm's own GEMM** (``pagedllm/csrc/cpu/gemm.cpp``) on fp32 weights, when the C++ CPU
  kernels run their ``avx2`` variant (a 6 x 16 AVX2 micro-kernel over weight panels packed
  k-major) or their ``avx512`` variant (12 x 16, one zmm register per row). AMD EPYC Zen 3
  (AVX2), the 121 linear layers of a SmolLM2-135M step (``benchmarks/gemm.py``): 1.12x oneDNN's
  speed at 64 rows (133 vs 119 GFLOP/s), 1.13x at 256, 1.23x at 2048, 1.49x at 4. AMD EPYC
  Zen 4 (AVX-512): 1.21x at 1 row, 1.08-1.23x at 4-64, 0.95-1.0x at 256-2048.
- **the own GEMM on bf16 weights** (``avx512`` variant on a CPU with AVX512-BF16,
  ``CpuOps.gemm_bf16_supported``): panels of (k, k + 1) bf16 pairs, x rounded to bf16 per call,
  products summed in fp32. On AMX CPUs the same panels run on AMX tiles (``csrc/cpu/
  gemm_amx.cpp``, TDPBF16PS, ``CpuOps.gemm_amx``; K a multiple of 32); elsewhere vdpbf16ps reads
  them. Zen 4 (vdpbf16ps): 1.2x oneDNN's bf16 at 1 row, 1.1x at 4-16, 0.97x at 64, 0.83x at 256,
  0.7x at 2048 (prefill). AMX Xeon, 2 cores (tiles): 1.0-1.2x oneDNN at 1-64 rows, 1.0x at 448,
  0.6x at 2048 (docs/dtype.md). Either way a bf16 model's layers run in the fused C++ decoder op
  (``layers.fused_layer``).
- **oneDNN's packed matmul** otherwise (bundled in PyTorch as MKL-DNN; ``mkldnn::
  _reorder_linear_weight`` / ``_linear_pointwise``, what Inductor's weight freezing uses):
  the ``scalar`` variant, bf16 on AMX CPUs whose own GEMM does not run the tiles (oneDNN's AMX
  kernels, :func:`bf16_tiles`: 4.7x the own GEMM's vdpbf16ps rate at 64 rows, docs/dtype.md),
  on AVX512-BF16 CPUs when the own GEMM is off, and whenever the extension is missing. MKL's
  plain sgemm (``F.linear``) re-reads the row-major weight on every call and was 10-40% slower
  than either at 64 rows. Without bf16 hardware bf16 weights stay on ``F.linear``.

The original parameters are dropped after packing, so memory does not grow (the LM head, tied to
the embedding, gets its own packed copy). ``PAGEDLLM_DISABLE_CPU_GEMM=1`` skips the own GEMM
(oneDNN then); ``PAGEDLLM_DISABLE_PACKED_LINEAR=1`` disables packing entirely (``F.linear``).
``PAGEDLLM_BF16_GEMM`` picks the bf16 kernel: ``auto`` (default: the own GEMM; oneDNN on AMX
CPUs only when the own GEMM's tiles are off, ``PAGEDLLM_GEMM_AMX=0``), ``own`` or ``onednn``.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from pagedllm.ops import CpuOps

logger = logging.getLogger(__name__)


def bf16_packing_available() -> bool:
    """Whether this CPU has bf16 matrix hardware (AVX512-BF16 or AMX-BF16 in ``/proc/cpuinfo``),
    the condition for packing bf16 weights for oneDNN."""
    from pagedllm.platform import cpu_flags

    flags = cpu_flags()
    return flags.amx_bf16 or flags.avx512_bf16


def bf16_tiles() -> bool:
    """Whether this CPU has AMX-BF16 tiles: there oneDNN's AMX kernels run bf16 weights (4.7x
    the own GEMM's vdpbf16ps rate at 64 rows on an AMX Xeon; only a single row was faster on the
    own GEMM, 1.55x; docs/dtype.md)."""
    from pagedllm.platform import cpu_flags

    return cpu_flags().amx_bf16


def onednn_linear_available(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether oneDNN packed linears can run: CPU, float32 (or bfloat16 on a CPU with bf16
    hardware, :func:`bf16_packing_available`), PyTorch built with MKL-DNN and the ops present."""
    if torch.device(device).type != "cpu":
        return False
    if dtype != torch.float32 and not (dtype == torch.bfloat16 and bf16_packing_available()):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


# The kernel variants whose GEMM (csrc/cpu/gemm.cpp) has a vector micro-kernel.
OWN_GEMM_SIMD_LEVELS = ("avx2", "avx512")


def cpu_gemm_ops(cpu_ops: CpuOps | None, dtype: torch.dtype) -> CpuOps | None:
    """``cpu_ops`` (the C++ CPU kernels) when its own GEMM should run the linears of ``dtype``
    weights: float32 on the ``avx2`` or ``avx512`` variant (``simd_level()``), bfloat16 where
    ``cpu_ops.gemm_bf16_supported()`` (the avx512 variant on a CPU with AVX512-BF16) and
    :func:`bf16_gemm_choice` is ``own``; not when disabled by ``PAGEDLLM_DISABLE_CPU_GEMM=1``;
    else None.

    Raises:
        ValueError: ``PAGEDLLM_BF16_GEMM`` is not auto, own or onednn (bf16 weights only).
    """
    # A bad PAGEDLLM_BF16_GEMM is an error on every CPU, not only where the own bf16 GEMM runs.
    choice = bf16_gemm_choice(cpu_ops) if dtype == torch.bfloat16 else None
    if cpu_ops is None or dtype not in (torch.float32, torch.bfloat16):
        return None
    if os.environ.get("PAGEDLLM_DISABLE_CPU_GEMM") == "1":
        return None
    if not hasattr(cpu_ops, "gemm_linear") or cpu_ops.simd_level() not in OWN_GEMM_SIMD_LEVELS:
        return None
    if dtype == torch.bfloat16 and (not cpu_ops.gemm_bf16_supported() or choice != "own"):
        return None
    return cpu_ops


def own_gemm_runs(dtype: torch.dtype) -> bool:
    """Whether the engine's CPU linears of ``dtype`` weights run on the own GEMM (packing on,
    :func:`cpu_gemm_ops` accepts the C++ kernels this process loads), whose every output row
    depends only on its own input row: a speculative verify pass of k + 1 rows then gives each
    row the bits a one-row decode would."""
    if os.environ.get("PAGEDLLM_DISABLE_PACKED_LINEAR") == "1":
        return False
    from pagedllm.attention.cpu import load_cpu_ops

    return cpu_gemm_ops(load_cpu_ops(), dtype) is not None


BF16_GEMM_CHOICES = ("auto", "own", "onednn")


def bf16_gemm_choice(cpu_ops: CpuOps | None = None) -> str:
    """Which kernel should run bf16 linears where both can: ``"own"`` or ``"onednn"``, from
    ``$PAGEDLLM_BF16_GEMM``. ``auto``, the default, is the own GEMM, except on CPUs with AMX-BF16
    tiles (:func:`bf16_tiles`) whose own GEMM does not run them (``cpu_ops.gemm_amx()`` false,
    e.g. ``PAGEDLLM_GEMM_AMX=0``): there oneDNN's AMX kernels beat its vdpbf16ps loop 4.7x at 64
    rows (docs/dtype.md).

    Raises:
        ValueError: the variable holds something else (the message names it).
    """
    choice = os.environ.get("PAGEDLLM_BF16_GEMM", "auto").strip().lower() or "auto"
    if choice not in BF16_GEMM_CHOICES:
        raise ValueError(
            f"PAGEDLLM_BF16_GEMM={choice!r}: expected one of {', '.join(BF16_GEMM_CHOICES)}"
        )
    if choice == "auto":
        own_tiles = cpu_ops is not None and cpu_ops.gemm_amx()
        return "onednn" if bf16_tiles() and not own_tiles else "own"
    return choice


def packed_linear_available(
    dtype: torch.dtype, device: torch.device | str = "cpu", cpu_ops: CpuOps | None = None
) -> bool:
    """Whether the linears can be packed (own GEMM through ``cpu_ops`` or oneDNN), and packing
    is not disabled by ``PAGEDLLM_DISABLE_PACKED_LINEAR=1``."""
    if os.environ.get("PAGEDLLM_DISABLE_PACKED_LINEAR") == "1":
        return False
    if torch.device(device).type != "cpu":  # cpu_gemm_ops does not look at the device
        return False
    return cpu_gemm_ops(cpu_ops, dtype) is not None or onednn_linear_available(dtype, device)


class PackedLinear(nn.Module):
    """y = x W^T (+ b) from a weight prepacked once.

    Args:
        weight: [out_features, in_features] float32 or bfloat16 CPU tensor (copied into the
            packed layout; the caller may drop it afterwards).
        cpu_ops: the C++ CPU kernels (:class:`pagedllm.ops.CpuOps`); when ``cpu_gemm_ops``
            accepts it for the weight's dtype the weight is packed into 16-column panels for
            its GEMM (bf16: (k, k + 1) pairs; x is rounded to bf16 and the products summed in
            fp32), otherwise into oneDNN's layout.
        bias: [out_features] of the weight's dtype, or None; added after the GEMM (oneDNN adds
            it itself).

    Forward: x [T, in_features] of the weight's dtype -> [T, out_features], same dtype (the
    own GEMM also takes float32 x with bf16 panels, and then returns float32).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        cpu_ops: CpuOps | None = None,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().contiguous()
        self.gemm_ops = cpu_gemm_ops(cpu_ops, weight.dtype)
        with torch.no_grad():
            w = weight.detach().contiguous()
            if self.gemm_ops is not None:
                self.packed = self.gemm_ops.gemm_pack_weight(w)
            else:
                # batch_size None: one layout for every number of rows (decode and prefill).
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None)

    @property
    def kernel(self) -> str:
        """Which GEMM runs: "pagedllm" (own) or "onednn"."""
        return "onednn" if self.gemm_ops is None else "pagedllm"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm_ops is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        # The kernels take float32 rows (bf16 panels round them to bf16 themselves).
        flat = x.reshape(-1, self.in_features).float()
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        y = self.gemm_ops.gemm_linear(flat, self.packed, self.out_features)
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def forward_float32(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features] -> x W^T (+ b) as float32 [T, out_features]. The own GEMM's fp32
        sums come back as they are (a bf16 weight's product is never rounded to bf16, e.g. an LM
        head's logits); oneDNN's product in the weight's dtype is converted."""
        if self.gemm_ops is None:
            return self(x).float()
        return self(x.float())

    def forward_add_(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out += x W^T in place and return ``out`` ([T, out_features] of the weight's dtype,
        unit inner stride, not aliasing x): the own GEMM adds in its epilogue (no [T,
        out_features] temporary, no separate add), oneDNN adds afterwards."""
        if (
            self.gemm_ops is not None
            and x.dim() == 2
            and x.stride(-1) == 1
            and x.dtype == out.dtype == torch.float32
        ):
            self.gemm_ops.gemm_linear_add_(out, x, self.packed)
            return out if self.bias is None else out.add_(self.bias)
        return out.add_(self(x))

    def extra_repr(self) -> str:
        bias = ", bias" if self.bias is not None else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}{bias}, {self.kernel}"
        )


class PackedSwiGLU(nn.Module):
    """silu(x W_gate^T) * (x W_up^T) in one pass of the own GEMM (Shazeer 2020's SwiGLU): the
    fused gate/up weight is packed so that each 16-column panel holds 8 gate and the matching 8 up
    columns, and the kernel's epilogue stores only the activation.

    Args:
        weight: [2I, in_features] float32 or bfloat16, gate rows then up rows; I a multiple of 8.
        gemm_ops: the C++ CPU kernels, accepted by :func:`cpu_gemm_ops` for the weight's dtype.

    Forward: x [T, in_features] -> [T, I] of x's dtype (computed from float32 rows).

    Raises:
        ValueError: naming ``weight`` when I is not a multiple of 8.
    """

    fused_activation = True  # forward returns the activation, not the [T, 2I] product

    def __init__(self, weight: torch.Tensor, gemm_ops: CpuOps) -> None:
        super().__init__()
        rows, self.in_features = weight.shape
        if rows % 16:
            raise ValueError(f"weight: {rows} gate/up rows, need 2I with I a multiple of 8")
        self.inter = rows // 2
        self.gemm_ops = gemm_ops
        with torch.no_grad():
            self.packed = gemm_ops.gemm_pack_swiglu_weight(weight.detach().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm_ops.gemm_swiglu(x.float().contiguous(), self.packed).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, inter={self.inter}, pagedllm SwiGLU epilogue"


def pack_swiglu_layers(model: nn.Module, cpu_ops: CpuOps | None) -> int:
    """Replace the ``gate_up_proj`` (a bias-free ``nn.Linear`` of 2I rows, I % 8 == 0) of every
    module that has one and whose ``act`` is "silu" (the default when it has no ``act``) by a
    :class:`PackedSwiGLU` when the own GEMM runs (``cpu_gemm_ops``). Returns the count (0 when it
    does not run)."""
    # PAGEDLLM_DISABLE_PACKED_LINEAR is the caller's gate, as for the others.
    count = 0
    for m in model.modules():
        proj = getattr(m, "gate_up_proj", None)
        if (
            getattr(m, "act", "silu") == "silu"
            and type(proj) is nn.Linear
            and proj.bias is None
            and proj.out_features % 16 == 0
        ):
            gemm = cpu_gemm_ops(cpu_ops, proj.weight.dtype)
            if gemm is not None:
                m.gate_up_proj = PackedSwiGLU(proj.weight, gemm)
                count += 1
    return count


def pack_linear_layers(model: nn.Module, cpu_ops: CpuOps | None = None) -> int:
    """Replace every ``nn.Linear`` in ``model`` (exact type, not subclasses, which may add
    communication) by a :class:`PackedLinear` holding the same weight and bias (own GEMM when
    ``cpu_ops`` qualifies, see :func:`cpu_gemm_ops`). Returns the count."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child.weight, cpu_ops, child.bias))
                count += 1
    return count
