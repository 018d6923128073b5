"""OLMo 2 (Team OLMo 2024, "2 OLMo 2 Furious", arXiv:2501.00656, section 3.1;
``Olmo2ForCausalLM``, ``model_type`` olmo2, GGUF ``olmo2``).

A Llama (grouped-query attention with RoPE, SwiGLU MLP, RMSNorm) with two changes for training
stability:

* the norms come AFTER the sublayers, on their outputs, inside the residual branch; there is no
  pre-norm: ``h = x + post_attention_layernorm(attn(x))``, then
  ``out = h + post_feedforward_layernorm(mlp(h))``;
* queries and keys get an RMSNorm over the whole projection before RoPE (width
  ``heads * head_dim`` for q, ``kv_heads * head_dim`` for k; one mean square per token and
  projection, not per head). Under tensor parallelism each rank holds its heads' slice of those
  weights and one all-reduce per layer gives the full-width mean squares
  (``layers.norm.rms_norm_across_ranks``).

CPU fast path: the linears are packed and the norms and rotary run on the C++ kernels, but the
whole-layer C++ op (``layers.fused_layer``) only knows Llama's pre-norm layer, so these layers run
their Python forward. llama.cpp writes OLMo 2 without q/k row permutation; its ``olmo2`` files
with an ``attention.sliding_window`` (OLMo 3) are refused, as are configs with ``clip_qkv``
(OLMo 1's option, which OLMo 2 does not use).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from gguf.constants import MODEL_TENSOR
from torch import nn

from pagedllm.distributed import TensorParallelGroup
from pagedllm.model.config import ModelArchConfig
from pagedllm.model.decoder import DecoderForCausalLM, StepContext
from pagedllm.model.layers.attention import PagedSelfAttention
from pagedllm.model.layers.mlp import GatedMLP
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.loader.gguf_loader import gguf_layer_tensor
from pagedllm.model.sharding import TensorParallelShard


class Olmo2DecoderLayer(nn.Module):
    """x + post_attn_norm(attn(x)), then + post_ffw_norm(mlp(...)) (post-norm residual branches).

    Args:
        config: architecture (``qk_norm_full_width`` set).
        index: layer index.
        dtype: parameter dtype.
        shard / group: tensor-parallel slice and group, or None.

    Forward: h [T, d], the layer's (key_cache, value_cache), the step context -> [T, d] (``h``
    updated in place: it is this step's own activation).
    """

    def __init__(
        self,
        config: ModelArchConfig,
        index: int,
        dtype: torch.dtype,
        shard: TensorParallelShard | None = None,
        group: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        inter = shard.intermediate_size if shard else config.intermediate_size
        self.self_attn = PagedSelfAttention(config, index, dtype, shard, group)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype)
        self.mlp = GatedMLP(d, inter, config.hidden_act, dtype, group)
        self.post_feedforward_layernorm = RMSNorm(d, eps, dtype)

    def forward(
        self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor:
        a = self.self_attn(ctx.rotations["global"], x, kv_cache, ctx.meta, ctx.backend)
        h = x.add_(self.post_attention_layernorm(a))
        return h.add_(self.post_feedforward_layernorm(self.mlp(h)))


class Olmo2ForCausalLM(DecoderForCausalLM):
    """OLMo 2 decoder (1B, 7B, 13B, 32B): post-norm layers with full-width q/k norms."""

    gguf_tensor_names: ClassVar[dict[str, str]] = {
        gguf_layer_tensor(MODEL_TENSOR.ATTN_POST_NORM): "post_attention_layernorm",
        gguf_layer_tensor(MODEL_TENSOR.FFN_POST_NORM): "post_feedforward_layernorm",
    }

    layer_class = Olmo2DecoderLayer

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """Full-width q/k norms; ``attention_bias`` puts a bias on q, k, v and o.

        Raises:
            ValueError: naming ``clip_qkv`` when it is set.
        """
        if cfg.get("clip_qkv") is not None:
            raise ValueError(f"OLMo 2 with clip_qkv ({cfg['clip_qkv']}) is not supported")
        bias = bool(cfg.get("attention_bias", False))
        return {
            "qk_norm": True,
            "qk_norm_full_width": True,
            "attention_bias": bias,
            "o_proj_bias": bias,
        }

    @classmethod
    def gguf_config_fields(cls, meta: Callable[[str], Any]) -> dict[str, Any]:
        """llama.cpp's ``olmo2`` keys are the common ones.

        Raises:
            ValueError: naming ``attention.sliding_window`` when the file has a window (llama.cpp
                writes OLMo 3 as ``olmo2`` with one; not supported).
        """
        window = meta("attention.sliding_window")
        if window:
            raise ValueError(
                f"olmo2 GGUF with attention.sliding_window ({window}, OLMo 3) is not supported"
            )
        return {"qk_norm": True, "qk_norm_full_width": True}
