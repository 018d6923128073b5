"""Phi-3 / Phi-3.5 / Phi-4-mini (Abdin et al. 2024, "Phi-3 Technical Report"; ``Phi3ForCausalLM``,
``model_type`` phi3): Llama layers whose checkpoint stores the q/k/v projections fused in one
``qkv_proj`` matrix and gate/up fused in ``gate_up_proj`` (split by name at load time,
``split_hf_weight``, so tensor-parallel slicing sees the usual parts), with
LongRoPE (``rope_scaling`` type "longrope": short factors up to
``original_max_position_embeddings`` tokens, long ones beyond, ``layers.rope_scaling``), partial
rotary (Phi-4-mini) and a sliding window on every layer when the config sets one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.weight_map import split_fused_tensor

if TYPE_CHECKING:
    import torch

    from pagedllm.model.config import ModelArchConfig


class Phi3ForCausalLM(LlamaForCausalLM):
    """Llama layers; the fused checkpoint tensors and LongRoPE are handled by the loader and the
    rotary table."""

    gguf_permute_qk: ClassVar[bool] = False
    # llama.cpp keeps Phi-3's fused tensors: attn_qkv = qkv_proj, ffn_up = gate_up_proj.
    gguf_tensor_names: ClassVar[dict[str, str]] = {
        "attn_qkv": "self_attn.qkv_proj",
        "ffn_up": "mlp.gate_up_proj",
    }
    # The loaders' per-model split hook: read whole, split, then cut per rank.
    splits_hf_weights: ClassVar[bool] = True

    @classmethod
    def split_hf_weight(
        cls, name: str, tensor: torch.Tensor, config: ModelArchConfig
    ) -> dict[str, torch.Tensor]:
        """``qkv_proj`` -> q/k/v, ``gate_up_proj`` -> gate/up (``weight_map.split_fused_tensor``);
        any other tensor unchanged."""
        return split_fused_tensor(name, tensor, config)

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """``original_max_position_embeddings`` (top level in Phi-3 configs) joins the LongRoPE
        dict; ``partial_rotary_factor`` may sit in ``rope_parameters`` (transformers 5)."""
        from pagedllm.model.config import hf_rope_parameters

        _, scaling = hf_rope_parameters(cfg)
        params = cfg.get("rope_parameters") or {}
        fields: dict[str, Any] = {"attention_bias": False, "o_proj_bias": False}
        partial = cfg.get("partial_rotary_factor", params.get("partial_rotary_factor"))
        if partial is not None:
            fields["partial_rotary_factor"] = float(partial)
        if scaling is not None:
            scaling.pop("partial_rotary_factor", None)
            original = cfg.get("original_max_position_embeddings")
            if original is not None:
                scaling.setdefault("original_max_position_embeddings", int(original))
            fields["rope_scaling"] = scaling
        return fields

    @classmethod
    def gguf_config_fields(cls, meta: Any) -> dict[str, Any]:
        """llama.cpp's phi3 keys: no ``attention.key_length`` (head_dim = hidden / heads),
        ``rope.dimension_count`` = the rotary width (partial rotary, Phi-4-mini) and
        ``attention.sliding_window`` (0 = none); the LongRoPE factors are tensors, read by
        ``gguf_loader``."""
        head_dim = int(meta("embedding_length")) // int(meta("attention.head_count"))
        rotary = meta("rope.dimension_count")
        window = meta("attention.sliding_window")
        return {
            "head_dim": head_dim,
            "partial_rotary_factor": int(rotary) / head_dim if rotary else 1.0,
            "sliding_window": int(window) if window else None,
            "attention_bias": False,
            "o_proj_bias": False,
        }
