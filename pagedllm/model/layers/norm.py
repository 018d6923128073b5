"""RMSNorm (Zhang & Sennrich 2019), plain, Gemma's ``1 + w`` form, per-head q/k norms (and
Cohere's per-head LayerNorms, ``layer_norm.HeadLayerNorm``), and norms over a width split across
tensor-parallel ranks (OLMo 2's full-width q/k norms)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.model.layers.layer_norm import HeadLayerNorm

if TYPE_CHECKING:
    from pagedllm.distributed import TensorParallelGroup
    from pagedllm.ops import CpuOps


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32.

    Gemma's norm multiplies by ``1 + w`` with ``w`` stored in the checkpoint; ``weight_offset``
    (1.0 there) is added to the checkpoint value once at load time (:meth:`load_weight`), so the
    forward, and the fused C++ kernel, are the same for every model.

    Args:
        size: normalized width d.
        eps: epsilon inside the square root.
        dtype: weight dtype.
        weight_offset: added to the checkpoint weight when loading.

    Forward: x [..., d] -> same shape and dtype.
    """

    def __init__(
        self, size: int, eps: float, dtype: torch.dtype, weight_offset: float = 0.0
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.weight_offset = weight_offset
        self.cpu_ops: CpuOps | None = None  # the C++ kernels when fused ops are on (fp32 / bf16, CPU)

    def load_weight(self, value: torch.Tensor) -> torch.Tensor:
        """The parameter value for checkpoint tensor ``value``: ``value + weight_offset``,
        added in float32 (as Gemma's forward computes ``1 + w``)."""
        if self.weight_offset == 0.0:
            return value
        return value.float() + self.weight_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_ops is not None and x.dim() == 2 and x.stride(-1) == 1:
            out = torch.empty_like(x)
            self.cpu_ops.rms_norm(out, x, self.weight, self.eps)
            return out
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_offset:  # Gemma rounds after the multiply, Llama before
            return (xf * self.weight.float()).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def norm_heads(norm: RMSNorm | HeadLayerNorm, x: torch.Tensor) -> torch.Tensor:
    """Apply ``norm`` to every head of ``x`` [T, heads, D] (a strided view is fine): an RMSNorm
    of width D shared by the heads (the q/k norms of Qwen3 and Gemma 3), or a
    :class:`HeadLayerNorm` with a weight row per head (Cohere). Returns a new contiguous
    [T, heads, D] tensor."""
    if isinstance(norm, HeadLayerNorm):
        return norm(x)
    t, heads, d = x.shape
    return norm(x.reshape(t * heads, d)).view(t, heads, d)


def rms_norm_across_ranks(
    norms: list[RMSNorm], xs: list[torch.Tensor], group: TensorParallelGroup
) -> list[torch.Tensor]:
    """RMSNorm of rows whose width is split over the tensor-parallel ranks: each ``xs[i]``
    [T, w_i] is this rank's slice of the full rows and ``norms[i]`` holds the matching slice of
    the weight; the mean square is taken over the full width. One all-reduce of the [T, n] sums of
    squares serves all ``n`` tensors.

    The divisor is ``world_size * w_i``: every rank holds ``w_i`` columns and, where ranks hold
    replicas (key heads when KV heads < ranks), every column is replicated equally often, so the
    mean over the gathered columns is the mean over the full width.

    Returns:
        the normalised tensors, [T, w_i] each, in the inputs' dtype.
    """
    squares = torch.stack([x.float().pow(2).sum(-1) for x in xs], dim=1)  # [T, n]
    squares = group.all_reduce(squares.contiguous())
    out = []
    for i, (norm, x) in enumerate(zip(norms, xs, strict=True)):
        mean = squares[:, i : i + 1] / (group.world_size * x.shape[-1])
        xf = x.float() * torch.rsqrt(mean + norm.eps)
        out.append(norm.weight * xf.to(x.dtype))
    return out
