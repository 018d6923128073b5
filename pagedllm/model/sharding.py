"""Which slice of each decoder weight a tensor-parallel rank holds (Megatron-LM sharding).

Shoeybi et al. 2019 (Megatron-LM, section 3): in each block the first linear layer is split by
output columns (column-parallel: fused QKV, fused gate/up) and the second by input rows
(row-parallel: o_proj, down_proj), so a rank computes its heads / its part of the SwiGLU width
without communication and one all-reduce sums the partial outputs. The embedding and the LM head
are split over the vocabulary. The vLLM paper (section 4.6) runs the same scheme with one
scheduler: every rank receives the same step input and holds only its shard of the weights and of
the KV cache.

Head assignment: rank r owns query heads [r * H / tp, (r + 1) * H / tp). Query head j reads KV
head j // (H / KVH), so rank r keeps exactly the KV heads its query heads read. When KVH is a
multiple of tp the KV heads are split evenly; when tp is a multiple of KVH (KVH < tp), each rank
keeps one KV head and ranks whose query heads share a group hold replicas of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.model.config import ModelArchConfig


@dataclass(frozen=True)
class TensorParallelShard:
    """Index ranges (half-open, in global units) that one rank owns.

    Attributes:
        rank / world_size: the rank and the tensor-parallel size.
        q_heads: query heads [lo, hi).
        kv_heads: key/value heads [lo, hi) (replicated across ranks when KVH < world_size).
        intermediate: SwiGLU inner columns [lo, hi).
        vocab: vocabulary rows [lo, hi); the last shard may be shorter than ``vocab_shard_size``.
        vocab_shard_size: rows of every rank's embedding / LM-head shard (ceil(V / world_size));
            a short last shard is padded with zero rows.
        expert_intermediate: inner columns [lo, hi) of every MoE expert (each expert is split
            like the dense MLP: gate/up by rows, down by columns).
        shared_expert_intermediate: inner columns [lo, hi) of the MoE layers' shared expert
            (Qwen2-MoE; split like the dense MLP, its [1, d] sigmoid gate stays whole).
        qk_norm_full_width: the q/k norm weights span all heads (OLMo 2), so they are cut with
            the rank's heads; per-head norms (Qwen3, Gemma 3) stay whole.
        qk_layer_norm: the q/k norm weights have one row per head (the per-head LayerNorms of
            Cohere and StableLM), so their rows are cut with the rank's heads.
    """

    rank: int
    world_size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_shard_size: int
    expert_intermediate: tuple[int, int] = (0, 0)
    shared_expert_intermediate: tuple[int, int] = (0, 0)
    qk_norm_full_width: bool = False
    qk_layer_norm: bool = False

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @classmethod
    def for_rank(cls, config: ModelArchConfig, rank: int, world_size: int) -> TensorParallelShard:
        """The shard of ``rank`` in a group of ``world_size``.

        Raises:
            ValueError: naming ``tensor_parallel_size`` when the query heads, the intermediate
                size or the experts' intermediate size are not divisible by it, or when the KV
                heads can be neither split (KVH % tp) nor replicated (tp % KVH); naming ``rank``
                when out of range.
        """
        tp = world_size
        h, kvh = config.num_attention_heads, config.num_key_value_heads
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
        if not 0 <= rank < tp:
            raise ValueError(f"rank must be in [0, {tp}), got {rank}")
        moe_inter = config.moe_intermediate_size or config.intermediate_size
        if config.num_experts and moe_inter % tp:
            raise ValueError(
                f"tensor_parallel_size ({tp}) must divide the experts' intermediate size "
                f"({moe_inter})"
            )
        shared_inter = config.shared_expert_intermediate_size or 0
        if shared_inter % tp:
            raise ValueError(
                f"tensor_parallel_size ({tp}) must divide shared_expert_intermediate_size "
                f"({shared_inter})"
            )
        if h % tp:
            raise ValueError(
                f"tensor_parallel_size ({tp}) must divide the number of query heads ({h})"
            )
        if config.intermediate_size % tp:
            raise ValueError(
                f"tensor_parallel_size ({tp}) must divide intermediate_size "
                f"({config.intermediate_size})"
            )
        if kvh % tp and tp % kvh:
            raise ValueError(
                f"tensor_parallel_size ({tp}) must divide or be a multiple of the number of "
                f"key/value heads ({kvh})"
            )
        local_h = h // tp
        group = h // kvh  # query heads per KV head
        q_lo = rank * local_h
        kv_lo = q_lo // group
        kv_hi = (q_lo + local_h - 1) // group + 1
        inter = config.intermediate_size // tp
        vs = -(-config.vocab_size // tp)
        v_lo = min(rank * vs, config.vocab_size)
        return cls(
            rank=rank,
            world_size=tp,
            q_heads=(q_lo, q_lo + local_h),
            kv_heads=(kv_lo, kv_hi),
            intermediate=(rank * inter, (rank + 1) * inter),
            vocab=(v_lo, min(v_lo + vs, config.vocab_size)),
            vocab_shard_size=vs,
            expert_intermediate=(rank * moe_inter // tp, (rank + 1) * moe_inter // tp),
            shared_expert_intermediate=(
                rank * shared_inter // tp,
                (rank + 1) * shared_inter // tp,
            ),
            qk_norm_full_width=config.qk_norm_full_width,
            qk_layer_norm=config.qk_layer_norm,
        )

    def weight_slice(self, name: str, head_dim: int) -> tuple[int, int, int] | None:
        """How to cut the Hugging Face-named weight ``name``: (dim, lo, hi), or None = whole.

        Linear weights are [out, in]: column-parallel layers (and their biases) are cut along
        dim 0, row-parallel ones along dim 1 (their biases stay whole); the embedding and LM head
        (its bias too) along the vocabulary (dim 0); norms stay whole (per-head q/k norms
        included), except full-width q/k norms (OLMo 2), cut with the rank's heads, and q/k
        norms with a weight row per head (Cohere, StableLM), whose rows are cut with the heads; attention
        sinks (GPT-OSS's ``self_attn.sinks``, one per query head) with the rank's query heads.
        MoE experts' biases follow their projections: gate / up biases are cut with the rows,
        a down bias stays whole (``layers.moe.StackedExperts`` adds it on rank 0 only).
        """
        d = head_dim
        if name in ("model.embed_tokens.weight", "lm_head.weight", "lm_head.bias"):
            return (0, *self.vocab)
        stem, _, kind = name.rpartition(".")  # kind: "weight" or "bias"
        row_parallel = kind == "weight"  # a row-parallel bias is whole (added after the reduce)
        if kind == "sinks" and stem.endswith("self_attn"):
            return (0, *self.q_heads)
        if stem.endswith("self_attn.q_proj"):
            return (0, self.q_heads[0] * d, self.q_heads[1] * d)
        if stem.endswith(("self_attn.k_proj", "self_attn.v_proj")):
            return (0, self.kv_heads[0] * d, self.kv_heads[1] * d)
        if stem.endswith("self_attn.o_proj") and row_parallel:
            return (1, self.q_heads[0] * d, self.q_heads[1] * d)
        if self.qk_norm_full_width and stem.endswith("self_attn.q_norm"):
            return (0, self.q_heads[0] * d, self.q_heads[1] * d)
        if self.qk_norm_full_width and stem.endswith("self_attn.k_norm"):
            return (0, self.kv_heads[0] * d, self.kv_heads[1] * d)
        if self.qk_layer_norm and stem.endswith("self_attn.q_norm"):  # [heads, head_dim]
            return (0, *self.q_heads)
        if self.qk_layer_norm and stem.endswith("self_attn.k_norm"):
            return (0, *self.kv_heads)
        if ".shared_expert." in stem:  # Qwen2-MoE's shared expert: a dense MLP of its own width
            if stem.endswith((".gate_proj", ".up_proj")):
                return (0, *self.shared_expert_intermediate)
            if stem.endswith(".down_proj") and row_parallel:
                return (1, *self.shared_expert_intermediate)
            return None
        if ".experts." in stem:  # MoE: Mixtral's w1 / w3 / w2, Qwen3-MoE's *_proj
            if stem.endswith((".w1", ".w3", ".gate_proj", ".up_proj")):
                return (0, *self.expert_intermediate)
            if stem.endswith((".w2", ".down_proj")) and row_parallel:
                return (1, *self.expert_intermediate)
            return None
        if stem.endswith(("mlp.gate_proj", "mlp.up_proj")):
            return (0, *self.intermediate)
        if stem.endswith("mlp.down_proj") and row_parallel:
            return (1, *self.intermediate)
        return None


def shard_state_dict(
    state_dict: dict[str, torch.Tensor], shard: TensorParallelShard, head_dim: int
) -> dict[str, torch.Tensor]:
    """This rank's slices of a full Hugging Face-named state dict (views, no copy).

    Returns:
        name -> tensor, same names; sharded weights narrowed per ``TensorParallelShard``.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        cut = shard.weight_slice(name, head_dim)
        out[name] = t if cut is None else t.narrow(cut[0], cut[1], cut[2] - cut[1])
    return out
