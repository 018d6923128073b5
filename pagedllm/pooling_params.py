"""Per-request pooling parameters: an embedding request instead of a generation.

A pooling request is prefilled like any prompt (batched, chunked, preempted like the others) but
samples nothing: the model runner returns its final hidden states (after the model's final
norm), which ``engine.pooling`` reduces to one vector. Shaped like vLLM's ``PoolingParams``.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The pooling methods: the mean of every prompt position's hidden state, or the last one's.
POOLING_TYPES = ("mean", "last")


@dataclass
class PoolingParams:
    """How a prompt's final hidden states become its embedding.

    Attributes:
        pooling_type: "mean" (average over every prompt position) or "last" (the last prompt
            position, as decoder embedding models trained with an EOS token use).
        normalize: divide the pooled vector by its L2 norm (as OpenAI's embeddings are); False
            returns the raw pooled hidden state.

    Raises:
        ValueError: naming the field, from ``__post_init__``.
    """

    pooling_type: str = "mean"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}"
            )
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
