"""GPT-NeoX (Black et al. 2022, "GPT-NeoX-20B"; Pythia; ``GPTNeoXForCausalLM``, ``model_type``
gpt_neox).

What differs from Llama: LayerNorm with bias, a GELU MLP with biases, biases on the attention
projections, partial rotary (only the first ``rotary_pct`` of each head's dimensions turn, in
the rotate-half layout) and a parallel residual (``use_parallel_residual``: attention and MLP
both read the layer input). The checkpoint fuses q, k and v in ``query_key_value`` with rows
interleaved per head ([q_h; k_h; v_h] for each head h), split at load; the LM head
(``embed_out``) is untied.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from pagedllm.model.config import ModelArchConfig, hf_rope_parameters
from pagedllm.model.layernorm_decoder import LayerNormDecoderForCausalLM, split_fused_qkv


class GPTNeoXForCausalLM(LayerNormDecoderForCausalLM):
    """GPT-NeoX-20B, Pythia and other ``gpt_neox`` checkpoints."""

    splits_hf_weights: ClassVar[bool] = True
    hf_skip: ClassVar[str | None] = r"\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)$"
    hf_weight_renames: ClassVar[tuple[tuple[str, str], ...]] = (
        (r"^gpt_neox\.embed_in\.", "model.embed_tokens."),
        (r"^gpt_neox\.final_layer_norm\.", "model.norm."),
        (r"^gpt_neox\.layers\.", "model.layers."),
        (r"\.attention\.query_key_value\.", ".self_attn.qkv_proj."),
        (r"\.attention\.dense\.", ".self_attn.o_proj."),
        (r"\.mlp\.dense_h_to_4h\.", ".mlp.up_proj."),
        (r"\.mlp\.dense_4h_to_h\.", ".mlp.down_proj."),
        (r"^embed_out\.", "lm_head."),
    )

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """Reads ``rotary_pct`` / ``rotary_emb_base`` (transformers 4) or ``rope_parameters``
        (``partial_rotary_factor``, ``rope_theta``; transformers 5), ``use_parallel_residual``,
        ``attention_bias`` and ``layer_norm_eps``."""
        params = cfg.get("rope_parameters") or {}
        _, scaling = hf_rope_parameters(cfg)
        theta = cfg.get("rotary_emb_base", params.get("rope_theta", 10000.0))
        pct = cfg.get("rotary_pct", params.get("partial_rotary_factor", 0.25))
        bias = bool(cfg.get("attention_bias", True))
        return {
            "hidden_act": str(cfg.get("hidden_act") or "gelu"),
            "attention_bias": bias,
            "o_proj_bias": bias,
            "mlp_bias": True,
            "layer_norm_eps": float(cfg.get("layer_norm_eps", 1e-5)),
            "parallel_residual": bool(cfg.get("use_parallel_residual", True)),
            "rope_theta": float(theta),
            "rope_scaling": scaling,
            "partial_rotary_factor": float(pct),
        }

    @classmethod
    def gguf_config_fields(cls, meta: Any) -> dict[str, Any]:
        """llama.cpp's gptneox keys: ``rope.dimension_count`` (the rotary width: partial rotary
        = it / head_dim), ``use_parallel_residual``, ``attention.layer_norm_epsilon``; the rope
        base is ``rope.freq_base`` (read by ``gguf_loader``), 10000 when absent."""
        fields = cls._gguf_layer_norm_fields(meta)
        rotary = meta("rope.dimension_count")
        parallel = meta("use_parallel_residual")
        return {
            **fields,
            "hidden_act": "gelu",
            "parallel_residual": True if parallel is None else bool(parallel),
            "partial_rotary_factor": int(rotary) / fields["head_dim"] if rotary else 1.0,
        }

    @classmethod
    def split_hf_weight(
        cls, name: str, tensor: torch.Tensor, config: ModelArchConfig
    ) -> dict[str, torch.Tensor]:
        """``query_key_value`` (rows interleaved per head) split in q/k/v."""
        if ".qkv_proj." in name:
            return split_fused_qkv(name, tensor, config.num_attention_heads, per_head=True)
        return {name: tensor}
