"""Llama (Touvron et al. 2023) and the decoders built the same way: pre-norm layers of grouped-
query attention with RoPE and a SwiGLU MLP. Qwen2, Qwen3, Mistral, Gemma (v1) and Granite subclass
it.

Projections are fused at load time (Q, K and V in one matrix; gate and up in another) so that a
layer does four matmuls instead of seven. On the CPU in fp32 the residual adds are fused into the
RMSNorm kernel and into the down projection's GEMM epilogue.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from pagedllm.distributed import TensorParallelGroup
from pagedllm.model.config import ModelArchConfig
from pagedllm.model.decoder import DecoderForCausalLM, StepContext
from pagedllm.model.layers.attention import PagedSelfAttention
from pagedllm.model.layers.mlp import GatedMLP
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.layers.rotary import apply_rotary, rope_inv_freq
from pagedllm.model.sharding import TensorParallelShard

__all__ = ["LlamaDecoderLayer", "LlamaForCausalLM", "apply_rotary", "rope_inv_freq"]


class LlamaDecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(...)) (pre-norm residual block).

    Args:
        config: architecture.
        index: layer index (its sliding window, if any).
        dtype: parameter dtype.
        shard / group: tensor-parallel slice and group, or None.
        mlp: the feed-forward block, called as ``mlp(x)`` or ``mlp(x, residual=r)``
            (``layers.moe.SparseMoeBlock``); None = a ``GatedMLP`` of ``intermediate_size``,
            with biases on gate, up and down when ``config.mlp_bias``.

    Forward: h [T, d], the layer's (key_cache, value_cache), the step context -> [T, d].
    """

    def __init__(
        self,
        config: ModelArchConfig,
        index: int,
        dtype: torch.dtype,
        shard: TensorParallelShard | None = None,
        group: TensorParallelGroup | None = None,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        eps, offset = config.rms_norm_eps, config.norm_weight_offset  # offset: Gemma's 1 + w
        inter = shard.intermediate_size if shard else config.intermediate_size
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, offset)
        self.self_attn = PagedSelfAttention(config, index, dtype, shard, group)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, offset)
        self.mlp = (
            mlp
            if mlp is not None
            else GatedMLP(
                config.hidden_size, inter, config.hidden_act, dtype, group, bias=config.mlp_bias
            )
        )

    def forward(
        self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor:
        rotate = ctx.rotations["global"]
        a = self.self_attn(rotate, self.input_layernorm(x), kv_cache, ctx.meta, ctx.backend)
        norm = self.post_attention_layernorm
        if norm.cpu_ops is not None:
            # One pass: x += a (x is this step's own activation, free to overwrite), a = norm(x).
            norm.cpu_ops.fused_add_rms_norm(a, x, norm.weight, norm.eps)
            return self.mlp(a, residual=x)  # x += mlp(a), in place
        h = x + a
        return h + self.mlp(norm(h))


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama 1-3, SmolLM and every checkpoint of ``model_type`` llama (``decoder`` has the
    forward, the LM head and the weight loading)."""

    gguf_permute_qk: ClassVar[bool] = True  # llama.cpp's converter interleaves Llama's q/k rows

    layer_class: ClassVar[type[nn.Module] | None] = LlamaDecoderLayer

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """Extra ``ModelArchConfig`` fields read from a Hugging Face ``config.json`` dict
        (the common ones are read by ``loader.hf_loader``): ``attention_bias`` (q/k/v and o)
        and ``mlp_bias`` (gate, up and down), both false by default as in transformers."""
        bias = bool(cfg.get("attention_bias", False))
        return {
            "attention_bias": bias,
            "o_proj_bias": bias,
            "mlp_bias": bool(cfg.get("mlp_bias", False)),
        }
