"""Gemma 3 text (Gemma Team 2025, "Gemma 3 Technical Report"; ``Gemma3ForCausalLM``,
``model_type`` gemma3_text, GGUF ``gemma3``).

What differs from Llama:

* RMSNorm multiplies by ``1 + w`` (folded into the weight at load: ``norm_weight_offset``), and
  each layer has four of them: before and after attention, before and after the MLP
  ("sandwich" norms, the post-norms applied to the branch before the residual add);
* per-head q/k RMSNorms before RoPE; attention scale ``query_pre_attn_scalar ** -0.5``;
* local layers (5 of every 6) attend within a sliding window and use RoPE base
  ``rope_local_base_freq`` (10k); global layers see everything with base ``rope_theta`` (1M)
  and the config's RoPE scaling;
* the embedding output is multiplied by sqrt(hidden_size); the MLP is GeGLU (GELU-tanh gate).

KV memory: every layer keeps every block (the paged cache has one block table per sequence for
all layers); freeing blocks that fell out of the local layers' window is left to the block
manager (docs/models.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from pagedllm.distributed import TensorParallelGroup
from pagedllm.model.config import ModelArchConfig, hf_rope_parameters
from pagedllm.model.decoder import DecoderForCausalLM, StepContext
from pagedllm.model.layers.attention import PagedSelfAttention
from pagedllm.model.layers.mlp import GatedMLP
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.sharding import TensorParallelShard

# Gemma 3 makes every sixth layer global (the config's ``sliding_window_pattern``).
DEFAULT_SLIDING_WINDOW_PATTERN = 6


def sliding_layer_types(num_layers: int, pattern: int) -> list[str]:
    """Gemma 3's layer types: layer i is global when (i + 1) % pattern == 0, else sliding."""
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    ]


class Gemma3DecoderLayer(nn.Module):
    """x + post_norm(attn(pre_norm(x))), then + post_ffw_norm(mlp(pre_ffw_norm(...))).

    Args:
        config: architecture.
        index: layer index (local or global: window and RoPE table).
        dtype: parameter dtype.
        shard / group: tensor-parallel slice and group, or None.

    Forward: h [T, d], the layer's (key_cache, value_cache), the step context -> [T, d].
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
        d, eps, off = config.hidden_size, config.rms_norm_eps, config.norm_weight_offset
        inter = shard.intermediate_size if shard else config.intermediate_size
        self.rope = "local" if config.layer_window(index) is not None else "global"
        self.input_layernorm = RMSNorm(d, eps, dtype, off)
        self.self_attn = PagedSelfAttention(config, index, dtype, shard, group)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype, off)
        self.pre_feedforward_layernorm = RMSNorm(d, eps, dtype, off)
        self.mlp = GatedMLP(d, inter, config.hidden_act, dtype, group)
        self.post_feedforward_layernorm = RMSNorm(d, eps, dtype, off)

    def forward(
        self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor:
        rotate = ctx.rotations.get(self.rope, ctx.rotations["global"])
        a = self.self_attn(rotate, self.input_layernorm(x), kv_cache, ctx.meta, ctx.backend)
        a = self.post_attention_layernorm(a)
        pre = self.pre_feedforward_layernorm
        if pre.cpu_ops is not None and a.dim() == 2:
            # One pass: x += a (x is this step's own activation), a = pre_ffw_norm(x).
            pre.cpu_ops.fused_add_rms_norm(a, x, pre.weight, pre.eps)
            return x.add_(self.post_feedforward_layernorm(self.mlp(a)))
        h = x + a
        return h + self.post_feedforward_layernorm(self.mlp(pre(h)))


class Gemma3ForCausalLM(DecoderForCausalLM):
    """Gemma 3 text decoder (270M, 1B; the text tower of the larger ones)."""

    gguf_tensor_names: ClassVar[dict[str, str]] = {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }

    layer_class = Gemma3DecoderLayer

    @staticmethod
    def _common_fields(hidden: int) -> dict[str, Any]:
        return {
            "qk_norm": True,
            "sandwich_norm": True,
            "norm_weight_offset": 1.0,
            "embedding_scale": math.sqrt(hidden),
        }

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """Reads ``rope_parameters`` per layer type (transformers 5) or ``rope_theta`` /
        ``rope_local_base_freq`` / ``rope_scaling`` (transformers 4), the layer types (or
        ``sliding_window_pattern``), ``query_pre_attn_scalar`` and the soft caps.

        Raises:
            ValueError: ``attn_logit_softcapping`` is set (not supported).
        """
        if cfg.get("attn_logit_softcapping") is not None:
            raise ValueError("Gemma 3 with attn_logit_softcapping is not supported")
        params = cfg.get("rope_parameters") or {}
        if "full_attention" in params:
            theta, scaling = hf_rope_parameters({}, params["full_attention"])
            local_theta, _ = hf_rope_parameters({}, params.get("sliding_attention") or {})
        else:
            theta, scaling = hf_rope_parameters({**cfg, "rope_theta": cfg.get("rope_theta", 1e6)})
            local_theta = float(cfg.get("rope_local_base_freq", 10000.0))
        n = int(cfg["num_hidden_layers"])
        pattern = int(cfg.get("sliding_window_pattern") or DEFAULT_SLIDING_WINDOW_PATTERN)
        window = cfg.get("sliding_window")
        layer_types = cfg.get("layer_types") or sliding_layer_types(n, pattern)
        bias = bool(cfg.get("attention_bias", False))
        return {
            **cls._common_fields(int(cfg["hidden_size"])),
            "hidden_act": str(cfg.get("hidden_activation") or "gelu_pytorch_tanh"),
            "rope_theta": theta,
            "rope_scaling": scaling,
            "rope_local_theta": local_theta,
            "sliding_window": int(window) if window else None,
            "layer_types": list(layer_types),
            "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or 256),
            "final_logit_softcapping": cfg.get("final_logit_softcapping"),
            "attention_bias": bias,
            "o_proj_bias": bias,
            "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        }

    @classmethod
    def gguf_config_fields(cls, meta: Callable[[str], Any]) -> dict[str, Any]:
        """llama.cpp's gemma3 keys: ``attention.sliding_window``, ``attention.key_length``
        (the query scale's base, as llama.cpp uses it), ``final_logit_softcapping``,
        ``attention.sliding_window_pattern`` (an int period or one flag per layer; default 6);
        the local RoPE base (10k) is fixed, as in llama.cpp."""
        n = int(meta("block_count"))
        pattern = meta("attention.sliding_window_pattern")
        if isinstance(pattern, list):  # one flag per layer, True = sliding
            types = ["sliding_attention" if p else "full_attention" for p in pattern]
        else:
            types = sliding_layer_types(n, int(pattern or DEFAULT_SLIDING_WINDOW_PATTERN))
        window = meta("attention.sliding_window")
        key_length = meta("attention.key_length")
        cap = meta("final_logit_softcapping")
        return {
            **cls._common_fields(int(meta("embedding_length"))),
            "hidden_act": "gelu_pytorch_tanh",
            "rope_local_theta": 10000.0,
            "sliding_window": int(window) if window else None,
            "layer_types": types,
            "query_pre_attn_scalar": float(key_length) if key_length else None,
            "final_logit_softcapping": float(cap) if cap else None,
        }
