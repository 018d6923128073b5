"""GLM-4 (Team GLM 2024, "ChatGLM: A Family of Large Language Models from GLM-130B to GLM-4 All
Tools"): ``GlmForCausalLM`` (``model_type`` glm; glm-4-9b-chat-hf) and its 0414 successor
``Glm4ForCausalLM`` (``model_type`` glm4, GGUF ``glm4``; GLM-4-9B/32B-0414 and the GLM-Z1
reasoning models, Z.ai / THUDM 2025 model cards).

What GLM changes from Llama:

* RoPE turns only part of each head (``partial_rotary_factor``, 0.5 when the config is silent,
  as transformers), and inside that part it rotates interleaved pairs (2i, 2i + 1) at frequency
  i (GPT-J style) where Llama's rotate-half pairs (i, i + R/2). As for Cohere
  (``layers.interleaved_rope``) the first R rows of every q and k head are permuted once
  at load time, even dimensions then odd ones, the other D - R rows left in place: rotate-half
  on the permuted rows is the interleaved rotation of the original ones, and q and k share the
  permutation, so attention is unchanged. The rotary stays the C++ kernel and the layer stays
  a ``LlamaDecoderLayer`` (the fused per-step op runs it);
* q, k and v have biases by default (``attention_bias``, true in transformers), o_proj none;
* the checkpoint stores gate and up as one ``gate_up_proj`` matrix, split by name at load time
  (``weight_map.split_fused_tensor``, as Phi-3).

GLM-4-0414 adds "sandwich" norms: ``post_self_attn_layernorm`` and ``post_mlp_layernorm`` are
RMSNorms of the attention and MLP outputs before their residual adds: Gemma 3's sandwich layer
(``gemma3.Gemma3DecoderLayer``), its checkpoint names mapped at load.

Refused with an error naming the field: a ``partial_rotary_factor`` whose rotary width is odd
(the pairs would not close). llama.cpp's ``glm4`` converter keeps the q/k rows as in the checkpoint
(its graph rotates interleaved pairs), writes the rotary width as ``rope.dimension_count`` and
keeps ``gate_up_proj`` fused as ``ffn_up``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from pagedllm.model.config import ModelArchConfig, hf_rope_parameters
from pagedllm.model.gemma3 import Gemma3DecoderLayer
from pagedllm.model.layers.interleaved_rope import permute_interleaved_qk
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.weight_map import split_fused_tensor

# transformers' GlmConfig / Glm4Config default when the config names no factor.
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5


def _rotary_fields(partial: float, head_dim: int) -> dict[str, Any]:
    """The partial-rotary field, checked.

    Raises:
        ValueError: naming ``partial_rotary_factor`` when the rotary width is odd or zero.
    """
    rot = int(head_dim * partial)
    if rot <= 0 or rot % 2:
        raise ValueError(
            f"GLM with partial_rotary_factor={partial} (rotary width {rot} of head_dim "
            f"{head_dim}) is not supported: the interleaved pairs need an even, nonzero width"
        )
    return {"partial_rotary_factor": float(partial)}


class GlmForCausalLM(LlamaForCausalLM):
    """glm-4-9b-chat-hf: Llama layers with q/k/v biases, partial interleaved RoPE (a load-time
    row permutation) and a fused ``gate_up_proj`` in the checkpoint."""

    gguf_permute_qk: ClassVar[bool] = False  # llama.cpp's glm4 graph rotates interleaved pairs
    # llama.cpp keeps gate_up_proj fused as ffn_up.
    gguf_tensor_names: ClassVar[dict[str, str]] = {"ffn_up": "mlp.gate_up_proj"}
    splits_hf_weights: ClassVar[bool] = True
    # q/k rows are permuted at load time: --quantization gguf keeps them float.
    folded_projections: ClassVar[tuple[str, ...]] = ("self_attn.qkv_proj",)

    @classmethod
    def split_hf_weight(
        cls, name: str, tensor: torch.Tensor, config: ModelArchConfig
    ) -> dict[str, torch.Tensor]:
        """``gate_up_proj`` -> gate / up (``weight_map.split_fused_tensor``); others unchanged."""
        return split_fused_tensor(name, tensor, config)

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """``attention_bias`` (q, k and v only; true by default as in transformers) and
        ``partial_rotary_factor`` (top level, transformers 4, or in ``rope_parameters``,
        transformers 5; default 0.5), taken out of a non-default RoPE scaling dict.

        Raises:
            ValueError: naming ``partial_rotary_factor`` (see :func:`_rotary_fields`).
        """
        params = cfg.get("rope_parameters") or {}
        partial = cfg.get("partial_rotary_factor", params.get("partial_rotary_factor"))
        partial = DEFAULT_PARTIAL_ROTARY_FACTOR if partial is None else float(partial)
        n_head = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // n_head)
        fields: dict[str, Any] = {
            **_rotary_fields(partial, head_dim),
            "attention_bias": bool(cfg.get("attention_bias", True)),
            "o_proj_bias": False,
            "mlp_bias": False,
        }
        _, scaling = hf_rope_parameters(cfg)
        if scaling is not None:
            scaling.pop("partial_rotary_factor", None)
            fields["rope_scaling"] = scaling
        return fields

    @classmethod
    def gguf_config_fields(cls, meta: Callable[[str], Any]) -> dict[str, Any]:
        """llama.cpp's glm4 keys: ``rope.dimension_count`` is the rotary width (default half the
        head); q/k/v biases are read from the tensors' presence by the loader's common path."""
        n_head = int(meta("attention.head_count"))
        head_dim = int(meta("attention.key_length") or int(meta("embedding_length")) // n_head)
        rotary = meta("rope.dimension_count")
        partial = int(rotary) / head_dim if rotary else DEFAULT_PARTIAL_ROTARY_FACTOR
        return {
            **_rotary_fields(partial, head_dim),
            "head_dim": head_dim,
            "attention_bias": True,
            "o_proj_bias": False,
        }

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """``DecoderForCausalLM.load_weights``, then the rotated q and k rows (weights and
        biases; this rank's heads under tensor parallelism) of every head reordered for
        rotate-half RoPE (module docstring), before any packing or quantization reads them."""
        super().load_weights(state_dict)
        rot = int(self.config.head_dim * self.config.partial_rotary_factor)
        permute_interleaved_qk(self.layers, rot)


class Glm4ForCausalLM(GlmForCausalLM):
    """GLM-4-0414 / GLM-Z1: GLM with post-attention and post-MLP RMSNorms on the branches, the
    sandwich layer of Gemma 3 (``gemma3.Gemma3DecoderLayer``: no norm offset, no window here)
    under GLM-4's checkpoint names."""

    # llama.cpp's names, as Gemma 3's, plus the fused gate/up.
    gguf_tensor_names: ClassVar[dict[str, str]] = {
        "ffn_up": "mlp.gate_up_proj",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }
    layer_class = Gemma3DecoderLayer
    # GLM-4's norm names -> the sandwich layer's (its post_attention_layernorm is the pre-MLP one).
    _NORM_NAMES: ClassVar[dict[str, str]] = {
        "post_self_attn_layernorm": "post_attention_layernorm",
        "post_attention_layernorm": "pre_feedforward_layernorm",
        "post_mlp_layernorm": "post_feedforward_layernorm",
    }

    @classmethod
    def hf_weight_name(cls, name: str) -> str | None:
        """A layer's ``post_self_attn_layernorm`` / ``post_attention_layernorm`` /
        ``post_mlp_layernorm`` -> the sandwich layer's ``post_attention_layernorm`` /
        ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm``; the rest unchanged."""
        stem, dot, kind = name.rpartition(".")
        head, _, norm = stem.rpartition(".")
        if head.startswith("model.layers.") and norm in cls._NORM_NAMES:
            return f"{head}.{cls._NORM_NAMES[norm]}{dot}{kind}"
        return name
