"""Tensor-parallel layers (Shoeybi et al. 2019, Megatron-LM; vLLM paper section 4.6).

A column-parallel linear layer is a plain ``nn.Linear`` over this rank's output columns (see
``layers.linear.column_linear``), so it needs no class here. The layers below are the ones that
communicate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import TensorParallelGroup


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
    h: torch.Tensor, weight: torch.Tensor, group: TensorParallelGroup, vocab_size: int
) -> torch.Tensor | None:
    """LM head over a vocabulary shard, gathered to rank 0.

    Args:
        h: [S, d] final hidden states (the same on every rank).
        weight: [ceil(V / world_size), d] this rank's LM-head rows.
        group: the tensor-parallel group.
        vocab_size: V, to drop the padding rows of the last shard.

    Returns:
        [S, V] logits in ``h``'s dtype on rank 0; None on the other ranks.
    """
    full = group.gather_last_dim(F.linear(h, weight))
    return None if full is None else full[:, :vocab_size]
