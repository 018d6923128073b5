"""int8 W8A8 linear layers: ``--quantization int8``.

The scheme (LLM.int8()'s vector-wise quantization with its mixed-precision outlier decomposition,
Dettmers et al. 2022 sections 3.1-3.2; the W8A8 setting of SmoothQuant, Xiao et al. 2023
section 3):

- weights: symmetric per output channel, once at load: ``s_w[n] = absmax(W[n]) / 127``,
  ``q_w = round(W * 127 / absmax)`` in [-127, 127];
- activations: symmetric per token (row) at every call, the same formula on ``x[m]`` without
  its outliers, the elements with ``|x| > 6`` (:func:`int8_outlier_threshold`);
- ``y[m, n] = (q_x[m] . q_w[n]) * s_x[m] * s_w[n] (+ b[n]) + (o[m] . q_w[n]) * s_w[n]``, the
  first dot product exact in int32, the second (o = the row's outliers, zero elsewhere) in
  float32.

Without the outliers' decomposition a row holding one large activation (SmolLM2's later
down projections see 2000 where the row's other elements are near 1) quantized its other
elements with a step of ~16, most of them to zero: perplexity +3.1 % against fp32 on Zen 5, and
+2.1 % with it (``benchmarks/perplexity.py --texts 16``, docs/dtype.md). Each row has its own
outliers, so a row's result does not depend on the rows computed with it.

Lossy (perplexity in ``benchmarks/perplexity.py``), so opt-in only. Every projection of the
decoder layers becomes an :class:`Int8Linear` (fused QKV, fused gate/up, o/down; row-parallel
ones keep their all-reduce: under tensor parallelism each rank quantizes its own shard, and the
per-channel scales of a row-parallel shard are that shard's); the LM head stays in the model
dtype unless ``PAGEDLLM_INT8_LM_HEAD=1``; MoE experts stay in the model dtype (logged).

Kernels: ``int8_linear`` of the C++ CPU kernels (``pagedllm/csrc/cpu/int8_gemm.cpp``: AVX2
maddubs, AVX512-VNNI vpdpbusd or scalar, picked at run time); without them (e.g.
``PAGEDLLM_DISABLE_CPU_KERNELS=1``) ``torch._int_mm`` on the same quantized values, so both give
the same numbers (the outliers' float sums may differ in the last bits).
"""

from __future__ import annotations

import logging
import math
import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.model.layers.parallel import RowParallelLinear

if TYPE_CHECKING:
    from pagedllm.ops import CpuOps

logger = logging.getLogger(__name__)

INT8_PANEL = 16  # output columns per packed panel (int8_gemm.h kInt8Panel)


INT8_OUTLIER_THRESHOLD = 6.0  # int8_gemm.h kInt8OutlierThreshold (LLM.int8(), section 3.2)


def int8_outlier_threshold() -> float:
    """The activation magnitude above which an element is an outlier (computed in float, not
    int8): ``$PAGEDLLM_INT8_OUTLIER_THRESHOLD`` when set (0 = no outliers), else 6.0. The C++
    kernels read the same variable once per process, with the same rule.

    Raises:
        ValueError: when the variable is not a finite number >= 0.
    """
    value = os.environ.get("PAGEDLLM_INT8_OUTLIER_THRESHOLD", "").strip()
    if not value:
        return INT8_OUTLIER_THRESHOLD
    try:
        threshold = float(value)
    except ValueError:
        threshold = math.nan
    if not math.isfinite(threshold) or threshold < 0:
        raise ValueError(
            f"PAGEDLLM_INT8_OUTLIER_THRESHOLD must be a finite number >= 0 (0 = no outliers), "
            f"got {value!r}"
        )
    return threshold


def split_outliers(
    x: torch.Tensor, threshold: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``x`` [M, K] into (inliers, outliers), both [M, K] float32 and summing to ``x``:
    the elements with ``|x| > threshold`` (default :func:`int8_outlier_threshold`; <= 0: none)
    go to the outliers, zero in the inliers."""
    x = x.float()
    threshold = int8_outlier_threshold() if threshold is None else threshold
    if threshold <= 0:
        return x, torch.zeros_like(x)
    mask = x.abs() > threshold
    return x.masked_fill(mask, 0.0), torch.where(mask, x, torch.zeros_like(x))


def quantize_symmetric(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of each row (the C++ ``int8_quantize_rows`` formula).

    Args:
        x: [M, K] floating tensor.

    Returns:
        (q [M, K] int8 in [-127, 127], scale [M] float32 = absmax / 127); a zero row gives
        q = 0 and scale 0. ``q * scale`` approximates ``x`` within scale / 2 per element.
    """
    x = x.float()
    absmax = x.abs().amax(dim=-1)
    # A tensor divided by a tensor: IEEE division, as the C++ kernel's. ``127.0 / absmax`` (a
    # Python number over a tensor) multiplies by a reciprocal, 1 ulp off for ~25 % of values,
    # and moved codes at rounding ties.
    inv = torch.where(absmax > 0, torch.full_like(absmax, 127.0) / absmax, torch.zeros_like(absmax))
    q = (x * inv.unsqueeze(-1)).round().clamp_(-127, 127).to(torch.int8)
    return q, absmax / torch.full_like(absmax, 127.0)


def int8_matmul(
    q_x: torch.Tensor,
    s_x: torch.Tensor,
    q_w: torch.Tensor,
    s_w: torch.Tensor,
    bias: torch.Tensor | None = None,
    outliers: torch.Tensor | None = None,
) -> torch.Tensor:
    """The W8A8 product in PyTorch (``torch._int_mm``, exact int32): the reference the C++
    kernel equals and its fallback.

    Args:
        q_x: [M, K] int8; s_x: [M] float32. q_w: [N, K] int8; s_w: [N] float32.
        bias: [N] float32 or None.
        outliers: [M, K] float32, the activations left out of ``q_x`` (zero elsewhere;
            :func:`split_outliers`), or None.

    Returns:
        [M, N] float32 = (q_x @ q_w^T) * s_x[:, None] * s_w (+ bias), in that order,
        + (outliers @ q_w^T) * s_w.
    """
    if q_x.shape[0] == 0:
        acc = q_x.new_zeros(0, q_w.shape[0]).int()
    elif q_x.shape[1] == 1:
        # torch 2.13's _int_mm returns garbage for K = 1 on a Xeon with AMX-INT8 / AVX512-VNNI
        # (every M, N tried); the product is then an outer product, exact in int32.
        acc = q_x.int() * q_w.int().t()
    else:
        acc = torch._int_mm(q_x, q_w.t())
    y = acc.float() * s_x.unsqueeze(1) * s_w
    if bias is not None:
        y = y + bias
    if outliers is not None and q_x.shape[0] and bool(outliers.any()):
        y = y + (outliers @ q_w.float().t()) * s_w
    return y


def int8_kernel_ops(cpu_ops: CpuOps | None) -> CpuOps | None:
    """``cpu_ops`` when its build has the int8 GEMM, else None (PyTorch fallback)."""
    return cpu_ops if cpu_ops is not None and hasattr(cpu_ops, "int8_linear") else None


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W quantized to int8 per output channel, x per row (W8A8).

    Args:
        weight: [out_features, in_features] floating tensor (quantized here; the caller may drop
            it afterwards).
        bias: [out_features] or None; added in float32.
        cpu_ops: the C++ CPU kernels; when they have the int8 GEMM the weight is packed into its
            panels, else kept [N, K] int8 for ``torch._int_mm``.

    Attributes:
        record: with the C++ GEMM, the packed panels, ``wscale`` and ``wsum`` as one 1-D int8
            tensor (``CpuOps.int8_linear_record``; ``qweight``, ``wscale`` and ``wsum`` are views
            of it); None without.

    Forward: x [..., in_features] float32 or bfloat16 -> [..., out_features], x's dtype.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        cpu_ops: CpuOps | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.ops = int8_kernel_ops(cpu_ops)
        self.record: torch.Tensor | None = None
        with torch.no_grad():
            q, scale = quantize_symmetric(weight.detach())
            self.wscale = scale.contiguous()
            self.bias = None if bias is None else bias.detach().float().contiguous()
            if self.ops is not None:
                panels = -(-self.out_features // INT8_PANEL)
                wsum = torch.zeros(panels * INT8_PANEL, dtype=torch.int32)
                wsum[: self.out_features] = q.sum(dim=1, dtype=torch.int32)
                packed = self.ops.int8_pack_weight(q)
                # One tensor for the fused layers (int8_linear_record); the three are views.
                self.record = torch.cat(
                    [packed.view(-1), self.wscale.view(torch.int8), wsum.view(torch.int8)]
                )
                end = packed.numel() + 4 * self.out_features
                self.qweight = self.record[: packed.numel()].view(packed.shape)
                self.wscale = self.record[packed.numel() : end].view(torch.float32)
                self.wsum = self.record[end:].view(torch.int32)
            else:
                self.wsum = torch.empty(0, dtype=torch.int32)
                self.qweight = q

    @property
    def kernel(self) -> str:
        """Which int8 GEMM runs: "pagedllm-<isa>" (C++) or "torch._int_mm"."""
        return "torch._int_mm" if self.ops is None else f"pagedllm-{self.ops.int8_gemm_isa()}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features).float()
        if flat.shape[0] == 0:
            return x.new_empty(*lead, self.out_features)
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        if self.ops is not None:
            y = self.ops.int8_linear(
                flat, self.qweight, self.wscale, self.wsum, self.bias, self.out_features
            )
        else:
            inliers, outliers = split_outliers(flat)
            q, s = quantize_symmetric(inliers)
            y = int8_matmul(q, s, self.qweight, self.wscale, self.bias, outliers)
        return y.view(*lead, self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        bias = ", bias" if self.bias is not None else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}{bias}, "
            f"int8 W8A8, {self.kernel}"
        )


class Int8RowParallelLinear(Int8Linear):
    """:class:`Int8Linear` over this rank's input columns, then the all-reduce of the partial
    sums and the (replicated) bias once, as :class:`RowParallelLinear`."""

    def __init__(self, layer: RowParallelLinear, cpu_ops: CpuOps | None = None) -> None:
        super().__init__(layer.weight, None, cpu_ops)
        self.group = layer.group
        self.full_bias = None if layer.bias is None else layer.bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(super().forward(x))
        return y if self.full_bias is None else y.add_(self.full_bias.to(y.dtype))


def int8_lm_head_enabled() -> bool:
    """Whether ``PAGEDLLM_INT8_LM_HEAD=1`` asks for an int8 LM head too (default: the model dtype)."""
    return os.environ.get("PAGEDLLM_INT8_LM_HEAD") == "1"


def quantize_linear_layers(model: nn.Module, cpu_ops: CpuOps | None = None) -> int:
    """Replace every ``nn.Linear`` (exact type) and ``RowParallelLinear`` under ``model`` by
    its int8 counterpart; call after loading (and sharding), before ``pack_linears``. Returns the
    count. Stacked MoE experts are not ``nn.Linear`` and stay as they are (logged)."""
    count = 0
    experts = 0
    for parent in list(model.modules()):
        if hasattr(parent, "num_experts") and hasattr(parent, "pack"):
            experts += 1
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, Int8Linear(child.weight, child.bias, cpu_ops))
                count += 1
            elif type(child) is RowParallelLinear:
                setattr(parent, name, Int8RowParallelLinear(child, cpu_ops))
                count += 1
    if experts:
        logger.info(
            "int8: %d MoE expert stacks stay in the model dtype (only dense linears are "
            "quantized)",
            experts,
        )
    return count


def quantize_model(model: nn.Module, method: str, cpu_ops: CpuOps | None = None) -> int:
    """Quantize the decoder layers of ``model`` (its ``layers``) with ``method``; call after
    loading (and sharding). Returns the number of quantized matrices.

    Raises:
        ValueError: naming ``quantization`` when ``method`` is not "int8", or
            ``PAGEDLLM_INT8_OUTLIER_THRESHOLD`` when it is not a number >= 0.
    """
    if method != "int8":
        raise ValueError(f"quantization must be int8 (or None), got {method!r}")
    threshold = int8_outlier_threshold()  # a bad value fails here, before any layer runs
    layers = getattr(model, "layers", model)
    count = quantize_linear_layers(layers, cpu_ops)
    kernel = int8_kernel_ops(cpu_ops)
    logger.info(
        "int8 W8A8: %d linear layers quantized (kernel %s), activations above %g in float",
        count,
        "torch._int_mm" if kernel is None else f"pagedllm-{kernel.int8_gemm_isa()}",
        threshold,
    )
    return count
