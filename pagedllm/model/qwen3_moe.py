"""Qwen3-MoE (Qwen team 2025): Qwen3's attention (per-head q/k RMSNorm, no QKV bias) with sparse
mixture-of-experts MLPs (``layers.moe``): top-k of E SwiGLU experts of width
``moe_intermediate_size``, the k weights renormalised only when ``norm_topk_prob``. Layers listed
in ``mlp_only_layers``, or not on the ``decoder_sparse_step`` grid, keep a dense MLP of
``intermediate_size``."""

from __future__ import annotations

from typing import Any, ClassVar

from pagedllm.model.layers.moe import QWEN_MOE_NAMES, MoeCheckpointNames
from pagedllm.model.mixtral import MixtralForCausalLM


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    """Mixtral's MoE layers with Qwen3's q/k norms and dense layers where the config says."""

    gguf_permute_qk: ClassVar[bool] = False
    moe_names: ClassVar[MoeCheckpointNames] = QWEN_MOE_NAMES
    default_rope_theta: ClassVar[float] = 10000.0  # (Mixtral's is 1e6)

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        layers = int(cfg["num_hidden_layers"])
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        # As transformers' Qwen3MoeDecoderLayer: sparse unless listed, on every step-th layer.
        moe_layers = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
        bias = bool(cfg.get("attention_bias", False))
        return {
            "qk_norm": True,
            "attention_bias": bias,
            "o_proj_bias": bias,
            "num_experts": experts,
            "num_experts_per_tok": int(cfg.get("num_experts_per_tok", 8)),
            "moe_intermediate_size": int(
                cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
            ),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "moe_layers": moe_layers,
        }

    @classmethod
    def gguf_config_fields(cls, meta: Any) -> dict[str, Any]:
        """llama.cpp's ``qwen3moe`` keys: ``expert_count``, ``expert_used_count``,
        ``expert_feed_forward_length`` (the experts' width) and ``expert_weights_norm`` (absent:
        llama.cpp renormalises the top-k weights, as released Qwen3-MoE models do)."""
        norm = meta("expert_weights_norm")
        width = meta("expert_feed_forward_length") or meta("feed_forward_length")
        return {
            "qk_norm": True,
            "num_experts": int(meta("expert_count") or 0),
            "num_experts_per_tok": int(meta("expert_used_count") or 8),
            "moe_intermediate_size": int(width),
            "norm_topk_prob": True if norm is None else bool(norm),
        }
