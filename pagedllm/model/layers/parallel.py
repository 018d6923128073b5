"""Tensor-parallel layers (Shoeybi et al. 2019, Megatron-LM; vLLM paper section 4.6).

A column-parallel linear layer is a plain ``nn.Linear`` over this rank's output columns (see
``layers.linear.column_linear``), so it needs no class here. The layers below are the ones that
communicate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import TensorParallelGroup
from pagedllm.model.packed_linear import PackedLinear, cpu_gemm_ops

if TYPE_CHECKING:
    from pagedllm.ops import CpuOps


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_r @ W_r^T) + b: this rank's input columns; the partial sums are added,
    then the (whole, replicated) bias once.

    Args:
        in_features: this rank's share of the input width (elements).
        out_features: full output width (elements).
        group: the tensor-parallel group.
        dtype: weight dtype.
        device: where to allocate the weight (``"meta"`` lets ``torch.nn.utils.skip_init`` build
            it without the random init).
        bias: whether the layer has a bias ([out_features], the same on every rank).

    Forward: x [T, in_features] -> [T, out_features], same dtype, identical on every rank.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: TensorParallelGroup,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        bias: bool = False,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, dtype=dtype, device=device)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y.add_(self.bias)


class PackedRowParallelLinear(nn.Module):
    """A :class:`RowParallelLinear` whose shard is prepacked (:class:`PackedLinear`): with the
    own GEMM the partial sums stay float32 through the all-reduce and are rounded to the
    activations' dtype once, after the (replicated) bias. The own GEMM computes each row on its
    own, so a row's result never depends on how many rows the step has (ATen's bfloat16 matmul
    does: a speculative verify pass could then flip a near-tied greedy token).

    Args:
        layer: the loaded row-parallel layer (its weight is copied into the packed layout).
        cpu_ops: the C++ CPU kernels, as for :class:`PackedLinear` (None: oneDNN's layout, whose
            product comes back in the weight's dtype).

    Forward: x [T, in_features] -> [T, out_features] in x's dtype, identical on every rank.
    """

    def __init__(self, layer: RowParallelLinear, cpu_ops: CpuOps | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.linear = PackedLinear(layer.weight, cpu_ops)
        self.group = layer.group
        self.bias = None if layer.bias is None else layer.bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y = self.group.all_reduce(self.linear.forward_float32(flat).contiguous())
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        bias = ", bias" if self.bias is not None else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}{bias}, "
            f"{self.linear.kernel}, all-reduce"
        )


def pack_row_parallel_layers(model: nn.Module, cpu_ops: CpuOps | None = None) -> int:
    """Replace every :class:`RowParallelLinear` (exact type) under ``model`` by a
    :class:`PackedRowParallelLinear` when the own GEMM runs its dtype (``cpu_gemm_ops``; with
    oneDNN the layer stays on ATen, as before). Returns the count."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is RowParallelLinear and cpu_gemm_ops(cpu_ops, child.weight.dtype):
                setattr(parent, name, PackedRowParallelLinear(child, cpu_ops))
                count += 1
    return count


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows are split over the vocabulary: rank r holds ids [lo, hi).

    Each rank looks up the ids it owns, writes zeros for the others, and an all-reduce adds the
    ranks' rows, so every rank ends with the full embedding.

    Args:
        shard_rows: rows of this rank's shard (ceil(V / world_size); padding rows are zero).
        vocab_range: (lo, hi) global ids this rank owns.
        hidden_size: embedding width d.
        group: the tensor-parallel group.
        dtype: weight dtype.

    Forward: ids [T] int64 -> [T, d] in ``dtype``.
    """

    def __init__(
        self,
        shard_rows: int,
        vocab_range: tuple[int, int],
        hidden_size: int,
        group: TensorParallelGroup,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(shard_rows, hidden_size, dtype=dtype), requires_grad=False
        )
        self.lo, self.hi = vocab_range
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.lo) | (ids >= self.hi)
        h = F.embedding((ids - self.lo).masked_fill(outside, 0), self.weight)
        h.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(h)


def vocab_parallel_logits(
    h: torch.Tensor,
    weight: torch.Tensor,
    group: TensorParallelGroup,
    vocab_size: int,
    packed: PackedLinear | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """LM head over a vocabulary shard, gathered to rank 0.

    Args:
        h: [S, d] final hidden states (the same on every rank).
        weight: [ceil(V / world_size), d] this rank's LM-head rows.
        group: the tensor-parallel group.
        vocab_size: V, to drop the padding rows of the last shard.
        packed: ``weight`` prepacked, or None. Its float32 products are gathered as they are
            (a bfloat16 model's logits are not rounded to bfloat16, as without tensor
            parallelism).
        bias: [ceil(V / world_size)] this rank's LM-head bias rows (Phi), or None; added in
            float32 to the shard before the gather.

    Returns:
        [S, V] logits on rank 0 (float32 with ``packed`` or ``bias``, else ``h``'s dtype); None
        on the other ranks.
    """
    shard = packed.forward_float32(h) if packed is not None else F.linear(h, weight)
    if bias is not None:
        shard = shard.float().add_(bias.float())
    full = group.gather_last_dim(shard)
    return None if full is None else full[:, :vocab_size]
