"""GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners";
``GPT2LMHeadModel``, ``model_type`` gpt2).

What differs from Llama: learned absolute positions, LayerNorm with bias, a GELU-tanh
("gelu_new") MLP, biases everywhere, the LM head tied to the embedding; the checkpoint stores
its projections as ``Conv1D`` weights, [in, out] (transposed at load), and q, k and v fused in
``c_attn`` ([q; k; v] after the transpose, split at load).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from pagedllm.model.config import ModelArchConfig
from pagedllm.model.layernorm_decoder import LayerNormDecoderForCausalLM, split_fused_qkv


class GPT2LMHeadModel(LayerNormDecoderForCausalLM):
    """GPT-2 small ... XL, DistilGPT-2 and other ``gpt2`` checkpoints."""

    splits_hf_weights: ClassVar[bool] = True
    hf_skip: ClassVar[str | None] = r"\.attn\.(bias|masked_bias)$"
    hf_weight_renames: ClassVar[tuple[tuple[str, str], ...]] = (
        (r"^(transformer\.)?wte\.", "model.embed_tokens."),
        (r"^(transformer\.)?wpe\.", "model.embed_positions."),
        (r"^(transformer\.)?ln_f\.", "model.norm."),
        (r"^(transformer\.)?h\.(\d+)\.", r"model.layers.\2."),
        (r"\.ln_1\.", ".input_layernorm."),
        (r"\.ln_2\.", ".post_attention_layernorm."),
        (r"\.attn\.c_attn\.", ".self_attn.qkv_proj."),
        (r"\.attn\.c_proj\.", ".self_attn.o_proj."),
        (r"\.mlp\.c_fc\.", ".mlp.up_proj."),
        (r"\.mlp\.c_proj\.", ".mlp.down_proj."),
    )

    @classmethod
    def standardize_hf_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """GPT-2's names: ``n_embd``, ``n_layer``, ``n_head``, ``n_inner`` (None = 4 x width),
        ``n_positions``.

        Raises:
            ValueError: naming ``scale_attn_by_inverse_layer_idx`` when true or
                ``scale_attn_weights`` when false (other attention scales are not supported).
        """
        if cfg.get("scale_attn_by_inverse_layer_idx", False):
            raise ValueError("GPT-2 with scale_attn_by_inverse_layer_idx=true is not supported")
        if not cfg.get("scale_attn_weights", True):
            raise ValueError("GPT-2 with scale_attn_weights=false is not supported")
        hidden = cfg.get("n_embd", cfg.get("hidden_size"))
        out = {
            "hidden_size": hidden,
            "num_hidden_layers": cfg.get("n_layer", cfg.get("num_hidden_layers")),
            "num_attention_heads": cfg.get("n_head", cfg.get("num_attention_heads")),
            "max_position_embeddings": cfg.get(
                "n_positions", cfg.get("max_position_embeddings", 1024)
            ),
        }
        inner = cfg.get("n_inner")
        out["intermediate_size"] = inner if inner else (4 * hidden if hidden else None)
        return {**cfg, **{k: v for k, v in out.items() if v is not None}}

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        return {
            "hidden_act": str(cfg.get("activation_function") or "gelu_new"),
            "attention_bias": True,
            "o_proj_bias": True,
            "mlp_bias": True,
            "layer_norm_eps": float(cfg.get("layer_norm_epsilon", 1e-5)),
            "position_offset": 0,
            "tie_word_embeddings": True,  # GPT2LMHeadModel always ties its head
        }

    @classmethod
    def gguf_config_fields(cls, meta: Any) -> dict[str, Any]:
        """llama.cpp's gpt2 files: LayerNorm epsilon and sizes only; the activation is GPT-2's
        tanh GELU and the head tied (the converter also writes the embedding as ``output``)."""
        return {
            **cls._gguf_layer_norm_fields(meta),
            "hidden_act": "gelu_new",
            "position_offset": 0,
            "tie_word_embeddings": True,
        }

    @classmethod
    def split_hf_weight(
        cls, name: str, tensor: torch.Tensor, config: ModelArchConfig
    ) -> dict[str, torch.Tensor]:
        """Conv1D weights ([in, out]) transposed to [out, in]; ``c_attn`` split in q/k/v."""
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            tensor = tensor.t()
        if ".qkv_proj." in name:
            return split_fused_qkv(name, tensor, config.num_attention_heads, per_head=False)
        return {name: tensor}
