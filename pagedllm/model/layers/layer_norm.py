"""LayerNorm (Ba et al. 2016, "Layer Normalization"): with a bias, the norm of OPT, GPT-2 and
GPT-NeoX; without one (weight only, still mean-subtracting), Cohere's; per attention head with
one weight row per head, the q/k norms of Cohere (``use_qk_norm``) and StableLM
(``qk_layernorm``). It runs on ATen
(``F.layer_norm``); the fused C++ kernels cover RMSNorm only."""

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
        bias: whether it has the bias parameter; False = ``bias`` is None, nothing is added
            (Cohere).

    Forward: x [..., d] -> same shape and dtype (computed in float32 for lower precisions, as
    Hugging Face's models upcast).
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
        bias = None if self.bias is None else self.bias.float()
        y = F.layer_norm(x.float(), self.weight.shape, self.weight.float(), bias, self.eps)
        return y.to(x.dtype)


class HeadLayerNorm(nn.Module):
    """LayerNorm over each head's dimensions, weight only, with one weight row per head:
    (x - mean(x)) / sqrt(var(x) + eps) * weight[head] (Cohere's q/k norms, ``use_qk_norm``:
    transformers' ``CohereLayerNorm`` of shape (heads, head_dim); StableLM's ``qk_layernorm``:
    ``StableLmLayerNormPerHead``, one bias-free ``nn.LayerNorm`` per head, stacked at load).
    Computed in float32.

    Args:
        heads: heads normalised (this rank's under tensor parallelism: the weight rows are cut
            with the heads, ``model.sharding``).
        head_dim: elements per head.
        eps: epsilon inside the square root.
        dtype: weight dtype.

    Forward: x [T, heads, head_dim] (a strided view is fine) -> a new tensor, same shape and
    dtype.
    """

    def __init__(self, heads: int, head_dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(heads, head_dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.float(), x.shape[-1:], None, None, self.eps)
        return (y * self.weight.float()).to(x.dtype)
