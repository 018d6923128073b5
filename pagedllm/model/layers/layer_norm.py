"""LayerNorm with a bias (Ba et al. 2016, "Layer Normalization"): the norm of OPT, GPT-2 and
GPT-NeoX. It runs on ATen (``F.layer_norm``); the fused C++ kernels cover RMSNorm only."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LayerNorm(nn.Module):
    """(x - mean(x)) / sqrt(var(x) + eps) * weight + bias over the last dimension.

    Args:
        size: normalized width d.
        eps: epsilon inside the square root.
        dtype: parameter dtype.

    Forward: x [..., d] -> same shape and dtype (computed in float32 for lower precisions, as
    Hugging Face's models upcast).
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
        y = F.layer_norm(
            x.float(), self.weight.shape, self.weight.float(), self.bias.float(), self.eps
        )
        return y.to(x.dtype)
