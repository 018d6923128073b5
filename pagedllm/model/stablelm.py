"""StableLM: StableLM-3B-4E1T and StableLM 2 (Bellagente et al. 2024, "Stable LM 2 1.6B
Technical Report"; ``StableLmForCausalLM``, ``model_type`` stablelm).

What differs from Llama: LayerNorm with bias instead of RMSNorm, partial rotary (the first
``partial_rotary_factor`` of each head's dimensions turn, rotate-half layout), optional biases on
q, k and v (``use_qkv_bias``; none on the output projection or the SwiGLU MLP), and optionally a
parallel residual over one shared norm (``use_parallel_residual``: x + attn(ln(x)) + mlp(ln(x)),
no ``post_attention_layernorm``). The checkpoint uses Llama's tensor names.

With ``qk_layernorm`` (StableLM 2 12B) every query and key head goes through its own bias-free
LayerNorm over the whole head (epsilon ``layer_norm_eps``) before the partial RoPE, as
transformers' ``StableLmLayerNormPerHead``. The checkpoint stores one weight per head
(``self_attn.q_layernorm.norms.{h}.weight``); they are stacked into ``self_attn.q_norm.weight``
[heads, head_dim] (``layers.layer_norm.HeadLayerNorm``; cut with the heads under tensor
parallelism), the tensor llama.cpp's converter writes as ``attn_q_norm`` (no metadata key: its
presence is the switch).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from pagedllm.distributed import TensorParallelGroup
from pagedllm.model.config import ModelArchConfig
from pagedllm.model.layernorm_decoder import LayerNormDecoderForCausalLM, LayerNormDecoderLayer
from pagedllm.model.layers.mlp import GatedMLP
from pagedllm.model.phi import hf_rope_fields

# One head's q/k LayerNorm weight in a checkpoint: (layer prefix, "q" or "k", head).
_HEAD_NORM = re.compile(
    r"^(model\.layers\.\d+\.self_attn\.)([qk])_layernorm\.norms\.(\d+)\.weight$"
)


def gguf_head_layer_norm_fields(tensor_names: Collection[str]) -> dict[str, Any]:
    """``qk_layer_norm`` when a GGUF file has ``attn_q_norm`` tensors: llama.cpp's stablelm and
    command-r files record per-head q/k LayerNorms by these tensors alone (no key)."""
    return {"qk_layer_norm": "blk.0.attn_q_norm.weight" in tensor_names}


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
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """Reads ``use_qkv_bias``, ``use_parallel_residual``, ``qk_layernorm``,
        ``layer_norm_eps`` (also the q/k norms') and the rotary fields (partial rotary 0.25 by
        default, as transformers)."""
        parallel = bool(cfg.get("use_parallel_residual", False))
        return {
            "attention_bias": bool(cfg.get("use_qkv_bias", False)),
            "qk_layer_norm": bool(cfg.get("qk_layernorm", False)),
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

    @classmethod
    def gguf_tensor_fields(cls, tensor_names: Collection[str]) -> dict[str, Any]:
        """``qk_layer_norm`` per :func:`gguf_head_layer_norm_fields`."""
        return gguf_head_layer_norm_fields(tensor_names)

    @classmethod
    def stack_hf_weights(cls, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``qk_layernorm``'s per-head weights (``self_attn.q_layernorm.norms.{h}.weight``,
        [head_dim] each) stacked in head order into ``self_attn.q_norm.weight`` [heads,
        head_dim], likewise k; every other tensor as it is (a per-head bias, which transformers'
        norms do not have, stays and is refused as unused).

        Raises:
            ValueError: naming the stacked tensor when its heads are not numbered 0 .. n - 1.
        """
        out: dict[str, torch.Tensor] = {}
        heads: dict[str, dict[int, torch.Tensor]] = {}
        for name, t in state.items():
            m = _HEAD_NORM.match(name)
            if m is None:
                out[name] = t
            else:
                heads.setdefault(f"{m[1]}{m[2]}_norm.weight", {})[int(m[3])] = t
        for name, rows in heads.items():
            if sorted(rows) != list(range(len(rows))):
                raise ValueError(
                    f"{name}: per-head norms of heads {sorted(rows)}, expected 0..{len(rows) - 1}"
                )
            out[name] = torch.stack([rows[h] for h in range(len(rows))])
        return out
