"""Token embeddings: whole, or split over the vocabulary under tensor parallelism, optionally
scaled (Gemma multiplies the embedding output by sqrt(hidden_size))."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed import TensorParallelGroup
from pagedllm.model.layers.parallel import VocabParallelEmbedding
from pagedllm.model.sharding import TensorParallelShard


def token_embedding(
    vocab_size: int,
    hidden_size: int,
    dtype: torch.dtype,
    shard: TensorParallelShard | None = None,
    group: TensorParallelGroup | None = None,
) -> nn.Module:
    """The embedding table, uninitialized (``load_weights`` fills it).

    Returns:
        ``nn.Embedding`` [V, d] without a group; ``VocabParallelEmbedding`` holding this rank's
        ``shard.vocab_shard_size`` rows with one. Forward: ids [T] int64 -> [T, d] ``dtype``.
    """
    if group is None or shard is None:
        # ``_weight`` skips the random init (skip_init's meta-device normal_ would first import
        # torch._refs, ~3 s).
        return nn.Embedding(
            vocab_size, hidden_size, _weight=torch.empty(vocab_size, hidden_size, dtype=dtype)
        )
    return VocabParallelEmbedding(shard.vocab_shard_size, shard.vocab, hidden_size, group, dtype)


def scale_embedding(h: torch.Tensor, scale: float | None) -> torch.Tensor:
    """``h * scale`` in place (``h`` [T, d] is the step's own embedding output), rounded to
    ``h``'s dtype first as Gemma does; ``h`` unchanged when ``scale`` is None."""
    if scale is None:
        return h
    return h.mul_(torch.tensor(scale, dtype=h.dtype).item())
