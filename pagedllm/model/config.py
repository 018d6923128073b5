"""Architecture hyper-parameters of a Llama-family decoder, independent of the file format."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LlamaArchConfig:
    """Shape of a Llama-family model (Llama 1-3, SmolLM, Mistral without sliding window).

    Attributes:
        vocab_size: number of token ids (rows of the embedding).
        hidden_size: model width d (elements).
        intermediate_size: SwiGLU inner width (elements).
        num_hidden_layers: decoder layers.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (grouped-query attention when < query heads).
        head_dim: elements per head (usually hidden_size // num_attention_heads).
        rms_norm_eps: epsilon inside RMSNorm.
        rope_theta: RoPE base frequency.
        rope_scaling: Hugging Face style scaling dict (``{"rope_type": "llama3" | "linear" |
            "default", "factor": ..., ...}``) or None.
        max_position_embeddings: the model's trained context length (tokens).
        tie_word_embeddings: the LM head reuses the embedding matrix.
        bos_token_id: beginning-of-sequence id or None.
        eos_token_ids: every id that ends generation (model EOS, generation-config EOS, the chat
            template's end-of-turn token).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of KV cache one token occupies: 2 (K and V) x layers x kv_heads x head_dim x bytes.

        This is the paper's "2 x hidden x layers x bytes" (section 3) with grouped-query attention,
        where only ``num_key_value_heads * head_dim`` of the hidden width is cached.
        """
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes
