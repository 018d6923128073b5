"""What the serving layer reads about a model that never changes once its engine is built
(``ModelFacts``), and the read-only properties over them (``ModelFactsMixin``) that the engine
fronts share: ``AsyncLLMEngine`` (one engine, facts copied from it) and ``DataParallelEngine``
(N replicas, facts sent back by replica 0, memory summed over the replicas).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine

__all__ = ["ModelFacts", "ModelFactsMixin"]


@dataclass(frozen=True)
class ModelFacts:
    """Immutable facts about a served model (plain data: it pickles across Ray).

    Attributes:
        tokenizer: a private copy of the engine's tokenizer (for the event loop only).
        max_model_len: most tokens (prompt + output) of one sequence.
        vocab_size: token ids are in ``[0, vocab_size)``.
        hidden_size: width of the model's final hidden state (the size of an embedding).
        default_pooling: how embeddings pool unless a request says (``--pooling``).
        model: ``EngineConfig.model`` (None: the bundled default).
        block_size: tokens per KV block.
        memory_bytes: bytes the engine holds: weights + KV block pool + host swap pool, summed
            over tensor / pipeline ranks (each rank's pool counted; the stage with most layers
            sets the block size, so pipeline pools are a slight overcount).
    """

    tokenizer: Any
    max_model_len: int
    vocab_size: int
    hidden_size: int
    default_pooling: str
    model: str | None
    block_size: int
    memory_bytes: int

    @classmethod
    def of_engine(cls, engine: LLMEngine) -> ModelFacts:
        """Copy the facts of a built ``engine`` (nothing may step it meanwhile)."""
        try:
            tokenizer = copy.deepcopy(engine.tokenizer)
        except Exception:  # not copyable: share it (HF fast tokenizers copy fine)
            tokenizer = engine.tokenizer
        cfg = engine.config
        ranks = cfg.tensor_parallel_size * cfg.pipeline_parallel_size
        pool_blocks = engine.num_blocks + engine.block_manager.num_swap_blocks
        return cls(
            tokenizer=tokenizer,
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            hidden_size=engine.model_config.hidden_size,
            default_pooling=cfg.pooling,
            model=cfg.model,
            block_size=cfg.block_size,
            memory_bytes=engine.weight_bytes + pool_blocks * engine.block_bytes * ranks,
        )


class ModelFactsMixin:
    """Read-only properties over ``self._facts`` (a ``ModelFacts`` the subclass sets in its
    constructor): each fact is defined once for every engine front."""

    _facts: ModelFacts

    @property
    def facts(self) -> ModelFacts:
        """All the facts at once."""
        return self._facts

    @property
    def tokenizer(self) -> Any:
        """The event loop's own copy of the model's tokenizer (never used by an engine thread)."""
        return self._facts.tokenizer

    @property
    def max_model_len(self) -> int:
        """Most tokens (prompt + output) of one sequence."""
        return self._facts.max_model_len

    @property
    def vocab_size(self) -> int:
        """Token ids are in ``[0, vocab_size)``."""
        return self._facts.vocab_size

    @property
    def hidden_size(self) -> int:
        """Width of the model's final hidden state (the size of an embedding)."""
        return self._facts.hidden_size

    @property
    def default_pooling(self) -> str:
        """How embeddings pool the hidden states unless a request says (``--pooling``)."""
        return self._facts.default_pooling

    @property
    def model(self) -> str | None:
        """The model path or name loaded (``EngineConfig.model``; None: the bundled default)."""
        return self._facts.model

    @property
    def memory_bytes(self) -> int:
        """Bytes of weights + KV pools held (``ModelFacts.memory_bytes``; all replicas)."""
        return self._facts.memory_bytes
