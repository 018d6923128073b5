"""StableLM: StableLM-3B-4E1T and StableLM 2 (Bellagente et al. 2024, "Stable LM 2 1.6B
Technical Report"; ``StableLmForCausalLM``, ``model_type`` stablelm).

What differs from Llama: LayerNorm with bias instead of RMSNorm, partial rotary (the first
``partial_rotary_factor`` of each head's dimensions turn, rotate-half layout), optional biases on
q, k and v (``use_qkv_bias``; none on the output projection or the SwiGLU MLP), and optionally a
parallel residual over one shared norm (``use_parallel_residual``: x + attn(ln(x)) + mlp(ln(x)),
no ``post_attention_layernorm``). The checkpoint uses Llama's tensor names. The per-head q/k
LayerNorms of ``qk_layernorm`` (StableLM 2 12B) are refused.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from pagedllm.distributed import TensorParallelGroup
from pagedllm.model.config import ModelArchConfig
from pagedllm.model.layernorm_decoder import LayerNormDecoderForCausalLM, LayerNormDecoderLayer
from pagedllm.model.layers.mlp import GatedMLP
from pagedllm.model.phi import hf_rope_fields


class StableLmDecoderLayer(LayerNormDecoderLayer):
    """A LayerNorm decoder layer (sequential or parallel residual) with a SwiGLU MLP without
    biases."""

    @staticmethod
    def make_mlp(
        config: ModelArchConfig, inter: int, dtype: torch.dtype, group: TensorParallelGroup | None
    ) -> nn.Module:
        """The gated MLP (``gate_proj`` / ``up_proj`` / ``down_proj``, no biases)."""
        return GatedMLP(config.hidden_size, inter, config.hidden_act, dtype, group, bias=False)


class StableLmForCausalLM(LayerNormDecoderForCausalLM):
    """stablelm-3b-4e1t, stablelm-2-1_6b, stablelm-zephyr-3b and other ``stablelm``
    checkpoints."""

    layer_class = StableLmDecoderLayer
    gguf_tensor_names: ClassVar[dict[str, str]] = {}  # llama.cpp keeps q, k and v apart

    @classmethod
    def standardize_hf_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """The common keys as they are.

        Raises:
            ValueError: naming ``qk_layernorm`` when true.
        """
        if cfg.get("qk_layernorm", False):
            raise ValueError(
                "StableLM with qk_layernorm=true (per-head LayerNorms) is not supported"
            )
        return cfg

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """Reads ``use_qkv_bias``, ``use_parallel_residual``, ``layer_norm_eps`` and the rotary
        fields (partial rotary 0.25 by default, as transformers)."""
        parallel = bool(cfg.get("use_parallel_residual", False))
        return {
            "attention_bias": bool(cfg.get("use_qkv_bias", False)),
            "layer_norm_eps": float(cfg.get("layer_norm_eps", 1e-5)),
            "parallel_residual": parallel,
            "shared_input_norm": parallel,
            **hf_rope_fields(cfg, 0.25),
        }

    @classmethod
    def gguf_config_fields(cls, meta: Any) -> dict[str, Any]:
        """llama.cpp's stablelm keys: ``rope.dimension_count`` (the rotary width),
        ``use_parallel_residual`` (true when absent, as its converter writes),
        ``attention.layer_norm_epsilon``; head_dim = hidden / heads (q/k/v biases: the loader
        sets ``attention_bias`` when the file has them)."""
        hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
        rotary = meta("rope.dimension_count")
        eps = meta("attention.layer_norm_epsilon")
        parallel = meta("use_parallel_residual")
        parallel = True if parallel is None else bool(parallel)
        head_dim = hidden // heads
        return {
            "head_dim": head_dim,
            "layer_norm_eps": 1e-5 if eps is None else float(str(np.float32(eps))),
            "parallel_residual": parallel,
            "shared_input_norm": parallel,
            "partial_rotary_factor": int(rotary) / head_dim if rotary else 1.0,
        }
