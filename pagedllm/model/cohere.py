"""Cohere Command-R (Cohere For AI 2024, "Command R" model card; Aya 23, Aya Expanse: Aryabumi
et al. 2024, "Aya 23: Open Weight Releases to Further Multilingual Progress";
``CohereForCausalLM``, ``model_type`` cohere, GGUF ``command-r``).

What differs from Llama:

* a parallel residual over one shared norm: h = x + attn(ln(x)) + mlp(ln(x)), the layer has no
  second norm (``shared_input_norm``);
* that norm, and the final one, is a LayerNorm without bias: it subtracts the mean and divides by
  the standard deviation, then multiplies by the weight (``layer_norm_bias`` False);
* the logits are multiplied by ``logit_scale`` (0.0625 in Command-R), after the tied LM head;
* RoPE rotates interleaved pairs of each head's dimensions, (2i, 2i + 1) at frequency i (GPT-J
  style): the q and k projection rows are permuted once at load time so that the rotate-half
  kernels compute it (``layers.interleaved_rope``);
* with ``use_qk_norm`` (Command R+ 08-2024) every query and key head goes through a bias-free
  LayerNorm over its dimensions before RoPE, with a weight row per head ([heads, head_dim]:
  ``layers.layer_norm.HeadLayerNorm``; permuted with the q/k rows, cut with the heads under
  tensor parallelism).

The SwiGLU MLP and the projections have no biases (``attention_bias`` adds them to q, k, v and
o). llama.cpp's converter keeps the checkpoint's q/k rows (its command-r graph rotates
interleaved pairs itself), writes ``logit_scale``, and stores the q/k norms as ``attn_q_norm`` /
``attn_k_norm`` ([heads, head_dim]; no metadata key: their presence is the switch).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, ClassVar

import numpy as np
import torch

from pagedllm.model.layernorm_decoder import LayerNormDecoderForCausalLM
from pagedllm.model.layers.interleaved_rope import permute_interleaved_qk
from pagedllm.model.stablelm import StableLmDecoderLayer, gguf_head_layer_norm_fields


def _gguf_float(value: Any) -> float | None:
    """A GGUF float32 value as the shortest decimal that round-trips, or None when absent."""
    return None if value is None else float(str(np.float32(value)))


class CohereForCausalLM(LayerNormDecoderForCausalLM):
    """Command-R, Command R+ (with or without q/k norms), Aya 23 / Expanse: parallel-residual
    layers over one bias-free LayerNorm, a SwiGLU MLP, interleaved RoPE (by a load-time row
    permutation) and scaled logits."""

    layer_class = StableLmDecoderLayer  # LayerNorm layer with a bias-free SwiGLU MLP
    gguf_tensor_names: ClassVar[dict[str, str]] = {}  # llama.cpp keeps q, k and v apart
    # q/k rows are permuted at load time: --quantization gguf keeps them float.
    folded_projections: ClassVar[tuple[str, ...]] = ("self_attn.qkv_proj",)
    default_rope_theta: ClassVar[float] = 500000.0

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """Reads ``logit_scale`` (transformers' default 0.0625), ``layer_norm_eps`` (also the
        q/k norms'), ``use_qk_norm``, ``attention_bias`` and the tied head (true by default, as
        transformers)."""
        bias = bool(cfg.get("attention_bias", False))
        scale = cfg.get("logit_scale", 0.0625)
        return {
            **_cohere_fields(None if scale is None else float(scale)),
            "qk_layer_norm": bool(cfg.get("use_qk_norm", False)),
            "attention_bias": bias,
            "o_proj_bias": bias,
            "layer_norm_eps": float(cfg.get("layer_norm_eps", 1e-5)),
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        }

    @classmethod
    def gguf_config_fields(cls, meta: Callable[[str], Any]) -> dict[str, Any]:
        """llama.cpp's command-r keys: ``logit_scale``, ``attention.layer_norm_epsilon`` (also
        the q/k norms', as llama.cpp's graph uses it)."""
        eps = meta("attention.layer_norm_epsilon")
        return {
            **_cohere_fields(_gguf_float(meta("logit_scale"))),
            "layer_norm_eps": 1e-5 if eps is None else float(str(np.float32(eps))),
        }

    @classmethod
    def gguf_tensor_fields(cls, tensor_names: Collection[str]) -> dict[str, Any]:
        """``qk_layer_norm`` when the file has ``attn_q_norm`` tensors (no key records it)."""
        return gguf_head_layer_norm_fields(tensor_names)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """``DecoderForCausalLM.load_weights``, then the q and k rows (weights and biases; this
        rank's heads under tensor parallelism) of every head, and the q/k norm weights, reordered
        for rotate-half RoPE (module docstring), before any packing or quantization reads them."""
        super().load_weights(state_dict)
        permute_interleaved_qk(self.layers)

    @torch.inference_mode()
    def compute_logits(self, h: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """``DecoderForCausalLM.compute_logits`` multiplied by ``logit_scale`` (in place, on the
        float32 logits)."""
        logits = super().compute_logits(h, logits_indices)
        if self.config.logit_scale is not None:
            logits.mul_(self.config.logit_scale)
        return logits


def _cohere_fields(logit_scale: float | None) -> dict[str, Any]:
    """What every Cohere config shares, whatever its format."""
    return {
        "parallel_residual": True,
        "shared_input_norm": True,
        "layer_norm_bias": False,
        "logit_scale": None if logit_scale in (None, 1.0) else logit_scale,
    }
