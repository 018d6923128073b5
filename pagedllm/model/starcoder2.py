"""Starcoder2 (Lozhkov et al. 2024, "StarCoder 2 and The Stack v2: The Next Generation";
``Starcoder2ForCausalLM``, ``model_type`` starcoder2).

What differs from Llama: LayerNorm with bias instead of RMSNorm, biases on every projection
(``use_bias``), a non-gated GELU-tanh MLP (``c_fc`` / ``c_proj``), and a sliding window on every
layer (``sliding_window``); attention is grouped-query with full rotary, the residual sequential
(pre-norm), and the LM head usually tied to the embedding.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from pagedllm.model.layernorm_decoder import LayerNormDecoderForCausalLM


class Starcoder2ForCausalLM(LayerNormDecoderForCausalLM):
    """starcoder2-3b / 7b / 15b and other ``starcoder2`` checkpoints."""

    hf_weight_renames: ClassVar[tuple[tuple[str, str], ...]] = (
        (r"\.mlp\.c_fc\.", ".mlp.up_proj."),
        (r"\.mlp\.c_proj\.", ".mlp.down_proj."),
    )
    gguf_tensor_names: ClassVar[dict[str, str]] = {}  # llama.cpp keeps q, k and v apart

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """Reads ``use_bias`` (every projection), ``norm_epsilon`` and ``hidden_act``
        (gelu_pytorch_tanh); the sliding window is read with the common fields."""
        bias = bool(cfg.get("use_bias", True))
        return {
            "hidden_act": str(cfg.get("hidden_act") or "gelu_pytorch_tanh"),
            "attention_bias": bias,
            "o_proj_bias": bias,
            "mlp_bias": bias,
            "layer_norm_eps": float(cfg.get("norm_epsilon", 1e-5)),
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        }

    @classmethod
    def gguf_config_fields(cls, meta: Any) -> dict[str, Any]:
        """llama.cpp's starcoder2 keys: ``attention.layer_norm_epsilon``, the rope base (read by
        ``gguf_loader``), ``attention.sliding_window`` when present (its converter writes none:
        such a file runs without the window); biases on every projection, GELU-tanh."""
        eps = meta("attention.layer_norm_epsilon")
        window = meta("attention.sliding_window")
        return {
            "hidden_act": "gelu_pytorch_tanh",
            "attention_bias": True,
            "o_proj_bias": True,
            "mlp_bias": True,
            "layer_norm_eps": 1e-5 if eps is None else float(str(np.float32(eps))),
            "sliding_window": int(window) if window else None,
        }
