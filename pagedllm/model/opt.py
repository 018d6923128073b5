"""OPT (Zhang et al. 2022, "OPT: Open Pre-trained Transformer Language Models"; the model the
vLLM paper measures; ``OPTForCausalLM``, ``model_type`` opt).

What differs from Llama: learned absolute positions (position p reads row p + 2 of the table),
LayerNorm with bias, a ReLU MLP (``fc1`` / ``fc2``) and biases on every projection; the LM head
is tied to the embedding. OPT-350m is post-norm (``do_layer_norm_before`` false, supported) and
projects 512-wide embeddings to the 1024-wide model (``word_embed_proj_dim``, refused).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pagedllm.model.layernorm_decoder import LayerNormDecoderForCausalLM

OPT_POSITION_OFFSET = 2  # OPT's learned position table starts at row 2 (a fairseq legacy)


class OPTForCausalLM(LayerNormDecoderForCausalLM):
    """OPT-125m ... 66b (pre-norm) and OPT-350m-style post-norm layers of equal width."""

    hf_weight_renames: ClassVar[tuple[tuple[str, str], ...]] = (
        (r"^(model\.)?decoder\.final_layer_norm\.", "model.norm."),
        (r"^(model\.)?decoder\.", "model."),
        (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
        (r"\.self_attn_layer_norm\.", ".input_layernorm."),
        (r"\.final_layer_norm\.", ".post_attention_layernorm."),
        (r"\.fc1\.", ".mlp.up_proj."),
        (r"\.fc2\.", ".mlp.down_proj."),
    )

    @classmethod
    def standardize_hf_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """``ffn_dim`` is the MLP width (``intermediate_size``).

        Raises:
            ValueError: naming ``word_embed_proj_dim`` when it differs from ``hidden_size``
                (project_in / project_out are not supported), ``layer_norm_elementwise_affine``
                when false, ``_remove_final_layer_norm`` when true.
        """
        hidden = cfg.get("hidden_size")
        proj = cfg.get("word_embed_proj_dim")
        if proj is not None and proj != hidden:
            raise ValueError(
                f"OPT with word_embed_proj_dim ({proj}) != hidden_size ({hidden}) is not "
                "supported (its project_in / project_out layers, as in OPT-350m)"
            )
        if not cfg.get("layer_norm_elementwise_affine", True):
            raise ValueError("OPT with layer_norm_elementwise_affine=false is not supported")
        if cfg.get("_remove_final_layer_norm", False):
            raise ValueError("OPT with _remove_final_layer_norm=true is not supported")
        return {**cfg, "intermediate_size": cfg.get("ffn_dim", cfg.get("intermediate_size"))}

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        bias = bool(cfg.get("enable_bias", True))
        return {
            "hidden_act": str(cfg.get("activation_function") or "relu"),
            "attention_bias": bias,
            "o_proj_bias": bias,
            "mlp_bias": bias,
            "layer_norm_eps": 1e-5,  # OPT uses nn.LayerNorm's default
            "norm_before": bool(cfg.get("do_layer_norm_before", True)),
            "position_offset": OPT_POSITION_OFFSET,
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        }
