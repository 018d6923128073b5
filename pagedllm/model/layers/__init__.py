"""Layers every model file builds on: linear (plain, column / row parallel, optional bias),
RMSNorm (incl. Gemma's ``1 + w``) and q/k norms, gated activations, rotary embeddings, token
embeddings (scaled), paged self-attention, the gated MLP, the sparse MoE block and the LM head
(soft-capped)."""

from pagedllm.model.layers.activation import activation_fn, gated_activation
from pagedllm.model.layers.attention import PagedSelfAttention
from pagedllm.model.layers.embedding import scale_embedding, token_embedding
from pagedllm.model.layers.linear import column_linear, row_linear, uninitialized
from pagedllm.model.layers.logits import lm_head_logits, soft_cap
from pagedllm.model.layers.mlp import GatedMLP
from pagedllm.model.layers.moe import SparseMoeBlock
from pagedllm.model.layers.norm import RMSNorm, norm_heads
from pagedllm.model.layers.parallel import (
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_logits,
)
from pagedllm.model.layers.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq

__all__ = [
    "GatedMLP",
    "PagedSelfAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SparseMoeBlock",
    "VocabParallelEmbedding",
    "activation_fn",
    "apply_rotary",
    "column_linear",
    "gated_activation",
    "lm_head_logits",
    "norm_heads",
    "rope_inv_freq",
    "row_linear",
    "scale_embedding",
    "soft_cap",
    "token_embedding",
    "uninitialized",
    "vocab_parallel_logits",
]
