"""Learned absolute position embeddings (Vaswani et al. 2017 section 3.5, learned variant; GPT-2,
OPT): a table of ``max_positions + offset`` rows added to the token embeddings. OPT reads
position p from row p + 2 (its offset); GPT-2 from row p."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LearnedPositionEmbedding(nn.Module):
    """The position table, uninitialized (``load_weights`` fills it); whole on every
    tensor-parallel rank (it is small next to the vocabulary).

    Args:
        max_positions: positions the model was trained on (``max_position_embeddings``).
        hidden_size: width d.
        offset: row of position 0 (OPT: 2).
        dtype: weight dtype.

    Forward: positions [T] int64 in [0, max_positions) -> [T, d] ``dtype``.
    """

    def __init__(
        self, max_positions: int, hidden_size: int, offset: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(max_positions + offset, hidden_size, dtype=dtype), requires_grad=False
        )
        self.offset = offset

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions + self.offset if self.offset else positions, self.weight)
