"""Mixtral (Jiang et al. 2024, "Mixtral of Experts"): Mistral's attention (grouped-query, RoPE,
sliding window when ``sliding_window`` is set) with every MLP replaced by a sparse
mixture-of-experts block: a router picks the top-k of E SwiGLU experts per token and renormalises
their weights (``layers.moe``). Qwen3-MoE subclasses it.

The experts of a step run grouped: each routed expert once over all the tokens routed to it
(``layers.moe.SparseMoeBlock``). Under tensor parallelism every expert's intermediate width is
split over the ranks (``model.sharding``), the router is replicated.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from pagedllm.distributed import TensorParallelGroup
from pagedllm.model.config import ModelArchConfig
from pagedllm.model.layers.activation import clamped_swiglu
from pagedllm.model.layers.moe import (
    MIXTRAL_NAMES,
    GateLinear,
    MoeCheckpointNames,
    SharedExpertMoeBlock,
    SparseMoeBlock,
    StackedExperts,
)
from pagedllm.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from pagedllm.model.sharding import TensorParallelShard

if TYPE_CHECKING:
    from pagedllm.ops import CpuOps


class MixtralForCausalLM(LlamaForCausalLM):
    """Llama layers whose MLP is a :class:`SparseMoeBlock` in the layers
    ``config.layer_is_moe`` names (a dense ``GatedMLP`` in the others).

    Class attributes:
        moe_names: how the checkpoint names the MoE tensors.
    """

    moe_names: ClassVar[MoeCheckpointNames] = MIXTRAL_NAMES
    default_rope_theta: ClassVar[float] = 1e6

    def make_layer(
        self,
        config: ModelArchConfig,
        index: int,
        dtype: torch.dtype,
        shard: TensorParallelShard | None,
        group: TensorParallelGroup | None,
    ) -> nn.Module:
        mlp = (
            self.make_moe_block(config, dtype, shard, group) if config.layer_is_moe(index) else None
        )
        return LlamaDecoderLayer(config, index, dtype, shard, group, mlp=mlp)

    def make_moe_block(
        self,
        config: ModelArchConfig,
        dtype: torch.dtype,
        shard: TensorParallelShard | None,
        group: TensorParallelGroup | None,
    ) -> SparseMoeBlock:
        """One layer's MoE block (this rank's expert slices under tensor parallelism); a
        :class:`SharedExpertMoeBlock` when ``config.shared_expert_intermediate_size`` is set
        (gated as ``config.shared_expert_gated`` says); routed as
        ``config.router_top_k_then_softmax`` says; with biases (``config.moe_bias``) and
        GPT-OSS's clamped SwiGLU (``config.swiglu_limit``) when the config says so (a shared
        expert is never combined with them)."""
        inter = config.moe_intermediate_size or config.intermediate_size
        shared = config.shared_expert_intermediate_size
        if shard is not None:
            inter = shard.expert_intermediate[1] - shard.expert_intermediate[0]
            lo, hi = shard.shared_expert_intermediate
            shared = hi - lo if shared else None
        routed = (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob)
        order = config.router_top_k_then_softmax
        glu = None
        if config.swiglu_limit is not None:  # GPT-OSS's clamped SwiGLU
            glu = partial(
                clamped_swiglu, inter=inter, alpha=config.swiglu_alpha, limit=config.swiglu_limit
            )
        if shared:
            return SharedExpertMoeBlock(
                config.hidden_size,
                inter,
                shared,
                *routed,
                config.hidden_act,
                dtype,
                self.moe_names,
                group,
                softmax_after_top_k=order,
                gated=config.shared_expert_gated,
            )
        return SparseMoeBlock(
            config.hidden_size,
            inter,
            *routed,
            config.hidden_act,
            dtype,
            self.moe_names,
            group,
            softmax_after_top_k=order,
            bias=config.moe_bias,
            glu=glu,
        )

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        return {
            "num_experts": int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0),
            "num_experts_per_tok": int(cfg.get("num_experts_per_tok", 2)),
            "norm_topk_prob": True,  # Mixtral always renormalises the top-k weights
        }

    @classmethod
    def gguf_config_fields(cls, meta: Any) -> dict[str, Any]:
        """llama.cpp writes Mixtral as ``llama`` with ``expert_count`` / ``expert_used_count``;
        a window is read from ``attention.sliding_window`` when a file has one (the converter
        writes none: released Mixtral checkpoints have no window)."""
        window = meta("attention.sliding_window")
        return {
            "num_experts": int(meta("expert_count") or 0),
            "num_experts_per_tok": int(meta("expert_used_count") or 2),
            "norm_topk_prob": True,
            "sliding_window": int(window) if window else None,
        }

    def pack_linears(self, cpu_ops: CpuOps | None = None) -> int:
        """The dense projections (``DecoderForCausalLM.pack_linears``), every expert
        (``StackedExperts.pack``) and the routers and shared-expert gates (``GateLinear.pack``: on
        the own GEMM only)."""
        count = super().pack_linears(cpu_ops)
        for m in self.modules():
            if isinstance(m, (StackedExperts, GateLinear)):
                count += m.pack(cpu_ops)
        return count

    def use_cpu_layer_ops(self, ops: CpuOps | None) -> None:
        """As ``DecoderForCausalLM.use_cpu_layer_ops``, plus the fused SiLU of the experts."""
        super().use_cpu_layer_ops(ops)
        if self.dtype in (torch.float32, torch.bfloat16):
            for m in self.modules():
                if isinstance(m, StackedExperts):
                    m.cpu_ops = ops
