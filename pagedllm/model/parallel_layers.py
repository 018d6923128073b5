"""Moved to :mod:`pagedllm.model.layers.parallel`; re-exported here for existing imports."""

from pagedllm.model.layers.parallel import (
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_logits,
)

__all__ = ["RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_logits"]
