"""Gemma 2 (Gemma Team 2024, "Gemma 2: Improving Open Language Models at a Practical Size";
``Gemma2ForCausalLM``, ``model_type`` gemma2, GGUF ``gemma2``).

The Gemma 3 layer (``gemma3.Gemma3DecoderLayer``: ``1 + w`` RMSNorms before and after attention
and the MLP, GeGLU, the embedding scaled by sqrt(hidden_size), attention scale
``query_pre_attn_scalar ** -0.5``) without the q/k norms and with one RoPE base for every layer,
plus (section 2 of the report):

* local (sliding-window) and global layers alternate, the first one local;
* attention-logit soft-capping: scaled scores become ``cap * tanh(scores / cap)`` (cap 50)
  before the softmax. The C++ and Triton paged-attention kernels lack it, so these layers'
  attention runs on torch_native (``layers.attention.soft_cap_backend``); every other op of the
  layer stays on the fused fast path;
* final-logit soft-capping (cap 30) in the LM head (``layers.logits``).

KV memory: as Gemma 3, every layer keeps every block (docs/models.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedllm.model.config import hf_rope_parameters
from pagedllm.model.gemma3 import Gemma3ForCausalLM, sliding_layer_types

# Gemma 2 alternates: layer i is global when (i + 1) % 2 == 0.
GEMMA2_SLIDING_WINDOW_PATTERN = 2
# llama.cpp's query scale for Gemma 2 27B (46 layers): hidden_size / heads, not head_dim.
_GEMMA2_27B_LAYERS = 46


def _optional_float(value: Any) -> float | None:
    return float(value) if value else None


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2 decoder (2B, 9B, 27B); the layers are Gemma 3's, configured as Gemma 2."""

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """Reads ``rope_theta`` / ``rope_parameters``, the layer types (default: alternating,
        local first), ``query_pre_attn_scalar`` and both soft caps."""
        theta, scaling = hf_rope_parameters(cfg)
        n = int(cfg["num_hidden_layers"])
        window = cfg.get("sliding_window")
        types = cfg.get("layer_types") or sliding_layer_types(n, GEMMA2_SLIDING_WINDOW_PATTERN)
        bias = bool(cfg.get("attention_bias", False))
        return {
            **cls._common_fields(int(cfg["hidden_size"])),
            "qk_norm": False,
            "hidden_act": str(cfg.get("hidden_activation") or "gelu_pytorch_tanh"),
            "rope_theta": theta,
            "rope_scaling": scaling,
            "sliding_window": int(window) if window else None,
            "layer_types": list(types),
            "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or 256),
            "final_logit_softcapping": _optional_float(cfg.get("final_logit_softcapping")),
            "attn_logit_softcapping": _optional_float(cfg.get("attn_logit_softcapping")),
            "attention_bias": bias,
            "o_proj_bias": bias,
            "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        }

    @classmethod
    def gguf_config_fields(cls, meta: Callable[[str], Any]) -> dict[str, Any]:
        """llama.cpp's gemma2 keys: ``attention.sliding_window``, ``attn_logit_softcapping``,
        ``final_logit_softcapping``; layers alternate local / global as in llama.cpp. The query
        scale's base is not stored: like llama.cpp, ``attention.key_length`` (2B, 9B), or
        hidden_size / heads for the 46-layer 27B."""
        n = int(meta("block_count"))
        hidden = int(meta("embedding_length"))
        window = meta("attention.sliding_window")
        key_length = meta("attention.key_length")
        scalar = float(key_length) if key_length else None
        if n == _GEMMA2_27B_LAYERS:
            scalar = hidden / int(meta("attention.head_count"))
        return {
            **cls._common_fields(hidden),
            "qk_norm": False,
            "hidden_act": "gelu_pytorch_tanh",
            "sliding_window": int(window) if window else None,
            "layer_types": sliding_layer_types(n, GEMMA2_SLIDING_WINDOW_PATTERN),
            "query_pre_attn_scalar": scalar,
            "final_logit_softcapping": _optional_float(meta("final_logit_softcapping")),
            "attn_logit_softcapping": _optional_float(meta("attn_logit_softcapping")),
        }
