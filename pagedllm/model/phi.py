"""Phi-1, Phi-1.5 and Phi-2 (Gunasekar et al. 2023, "Textbooks Are All You Need"; Li et al. 2023,
"Textbooks Are All You Need II: phi-1.5 technical report"; ``PhiForCausalLM``, ``model_type``
phi).

What differs from Llama: one LayerNorm (with bias) per layer whose output feeds attention and the
MLP in parallel, x + attn(ln(x)) + mlp(ln(x)); partial rotary (the first
``partial_rotary_factor`` of each head's dimensions turn, rotate-half layout); biases on q, k, v,
the output projection (``dense``) and the non-gated GELU-tanh MLP (``fc1`` / ``fc2``); a final
LayerNorm (``final_layernorm``) and an LM head with a bias. The per-head q/k LayerNorms of
``qk_layernorm`` (no released checkpoint sets it) are refused.

llama.cpp's ``phi2`` GGUF files converted from the transformers layout keep q, k and v apart;
older ones, converted from the original ``Wqkv``, hold one ``attn_qkv`` [q; k; v] per layer,
which the loader splits (``loader.gguf_expand``) before any tensor-parallel slicing.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pagedllm.model.config import hf_rope_parameters
from pagedllm.model.layernorm_decoder import LayerNormDecoderForCausalLM


def hf_partial_rotary(cfg: dict[str, Any], default: float) -> float:
    """``partial_rotary_factor`` of a ``config.json`` dict: top level (transformers 4) or in
    ``rope_parameters`` (transformers 5), else ``default``."""
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", default)))


def hf_rope_fields(cfg: dict[str, Any], default_partial: float) -> dict[str, Any]:
    """``rope_theta``, ``rope_scaling`` (without the partial-rotary key transformers 5 keeps in
    ``rope_parameters``) and ``partial_rotary_factor`` of a ``config.json`` dict."""
    theta, scaling = hf_rope_parameters(cfg)
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "partial_rotary_factor"}
    return {
        "rope_theta": theta,
        "rope_scaling": scaling,
        "partial_rotary_factor": hf_partial_rotary(cfg, default_partial),
    }


class PhiForCausalLM(LayerNormDecoderForCausalLM):
    """phi-1, phi-1_5, phi-2 and other ``phi`` checkpoints in the transformers layout."""

    hf_weight_renames: ClassVar[tuple[tuple[str, str], ...]] = (
        (r"^model\.final_layernorm\.", "model.norm."),
        (r"\.self_attn\.dense\.", ".self_attn.o_proj."),
        (r"\.mlp\.fc1\.", ".mlp.up_proj."),
        (r"\.mlp\.fc2\.", ".mlp.down_proj."),
    )

    @classmethod
    def standardize_hf_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """The common keys as they are.

        Raises:
            ValueError: naming ``qk_layernorm`` when true.
        """
        if cfg.get("qk_layernorm", False):
            raise ValueError("Phi with qk_layernorm=true is not supported")
        return cfg

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """Reads ``layer_norm_eps``, ``hidden_act`` (gelu_new), the rotary fields (partial
        rotary 0.5 by default, as transformers)."""
        return {
            "hidden_act": str(cfg.get("hidden_act") or "gelu_new"),
            "attention_bias": True,
            "o_proj_bias": True,
            "mlp_bias": True,
            "layer_norm_eps": float(cfg.get("layer_norm_eps", 1e-5)),
            "parallel_residual": True,
            "shared_input_norm": True,
            "lm_head_bias": True,
            **hf_rope_fields(cfg, 0.5),
        }

    @classmethod
    def gguf_config_fields(cls, meta: Any) -> dict[str, Any]:
        """llama.cpp's phi2 keys: ``rope.dimension_count`` (the rotary width),
        ``attention.layer_norm_epsilon``; head_dim = hidden / heads, GELU-tanh, the LM head's
        bias as ``output.bias``."""
        fields = cls._gguf_layer_norm_fields(meta)
        rotary = meta("rope.dimension_count")
        return {
            **fields,
            "hidden_act": "gelu_new",
            "parallel_residual": True,
            "shared_input_norm": True,
            "lm_head_bias": True,
            "partial_rotary_factor": int(rotary) / fields["head_dim"] if rotary else 1.0,
        }
