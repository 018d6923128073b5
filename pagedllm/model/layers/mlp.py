"""The gated feed-forward block: down(act(gate(x)) * up(x)), gate and up fused in one matrix
(SwiGLU / GeGLU, Shazeer 2020)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.distributed import TensorParallelGroup
from pagedllm.model.layers.activation import activation_fn, gated_activation
from pagedllm.model.layers.linear import column_linear, row_linear
from pagedllm.model.packed_linear import PackedLinear

if TYPE_CHECKING:
    from pagedllm.ops import CpuOps


class GatedMLP(nn.Module):
    """Gated MLP of width ``inter`` (this rank's share under tensor parallelism).

    Args:
        hidden: model width d.
        inter: inner width I of this rank.
        act: Hugging Face activation name ("silu", "gelu_pytorch_tanh", ...).
        dtype: parameter dtype.
        group: tensor-parallel group (down_proj all-reduces) or None.
        bias: the projections have biases.

    Attributes:
        act: the activation name; ``model.packed_linear.pack_swiglu_layers`` fuses only "silu"
            into the GEMM epilogue.

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
        bias: bool = False,
    ) -> None:
        super().__init__()
        activation_fn(act)  # validate early
        self.act = act
        self.inter = inter
        self.gate_up_proj = column_linear(hidden, 2 * inter, dtype, bias=bias)
        self.down_proj = row_linear(inter, hidden, group, dtype, bias=bias)
        self.cpu_ops: CpuOps | None = None  # the C++ kernels when fused ops are on (fp32 / bf16, CPU)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """[T, d] -> [T, d]; with ``residual`` ([T, d], this step's own activation) the result
        is added into it in place and ``residual`` is returned."""
        if getattr(self.gate_up_proj, "fused_activation", False):
            act = self.gate_up_proj(x)  # PackedSwiGLU: the activation straight from the GEMM
        else:
            act = gated_activation(self.gate_up_proj(x), self.inter, self.act, self.cpu_ops)
        if residual is None:
            return self.down_proj(act)
        if isinstance(self.down_proj, PackedLinear):
            return self.down_proj.forward_add_(residual, act)  # the add in the GEMM's epilogue
        return residual.add_(self.down_proj(act))
