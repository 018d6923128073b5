"""The non-gated feed-forward block of GPT-2, OPT and GPT-NeoX: down(act(up(x))) with biases
(Vaswani et al. 2017 section 3.3, with ReLU (OPT) or GELU (Hendrycks & Gimpel 2016; GPT-2's
tanh approximation, "gelu_new")). The projections are named ``up_proj`` / ``down_proj`` so that
tensor-parallel slicing (``model.sharding``) and CPU packing treat them like a gated MLP's."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed import TensorParallelGroup
from pagedllm.model.layers.activation import activation_fn
from pagedllm.model.layers.linear import column_linear, row_linear
from pagedllm.model.packed_linear import PackedLinear


class PlainMLP(nn.Module):
    """Feed-forward block of inner width ``inter`` (this rank's share under tensor parallelism);
    the arguments are ``GatedMLP``'s (``bias`` defaults to True here), ``act`` being applied
    to the whole up projection.

    Forward: x [T, d] -> [T, d]; with ``residual`` ([T, d], this step's own activation) the
    result is added into it in place (in the packed GEMM's epilogue on the CPU) and returned.

    Raises:
        ValueError: naming ``hidden_act`` when ``act`` is unknown.
    """

    def __init__(
        self,
        hidden: int,
        inter: int,
        act: str,
        dtype: torch.dtype,
        group: TensorParallelGroup | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.act_fn = activation_fn(act)
        self.act = act
        self.up_proj = column_linear(hidden, inter, dtype, bias=bias)
        self.down_proj = row_linear(inter, hidden, group, dtype, bias=bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        act = self.act_fn(self.up_proj(x))
        if residual is None:
            return self.down_proj(act)
        if isinstance(self.down_proj, PackedLinear):
            return self.down_proj.forward_add_(residual, act)
        return residual.add_(self.down_proj(act))
