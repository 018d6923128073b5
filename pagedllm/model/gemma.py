"""Gemma (Gemma Team 2024, "Gemma: Open Models Based on Gemini Research and Technology";
``GemmaForCausalLM``, ``model_type`` gemma, GGUF ``gemma``): the 2B and 7B models of the first
release, and their fine-tunes.

The layers are Llama's (``llama.LlamaDecoderLayer``: one RMSNorm before attention and one before
the MLP), configured as section 2 of the report describes:

* RMSNorm multiplies by ``1 + w`` (folded into the weight at load: ``norm_weight_offset``);
* the MLP is GeGLU, a gated GELU with the tanh approximation; transformers maps the
  ``hidden_act`` "gelu" of the released configs to "gelu_pytorch_tanh", and so does pagedllm;
* the embedding output is multiplied by sqrt(hidden_size), rounded to the model's dtype first;
* the attention scale is head_dim ** -0.5 (head_dim 256 on both sizes; the 2B model uses
  multi-query attention, one KV head);
* the LM head is the embedding (tied).

No sandwich norms, soft-capping or sliding windows (those came with Gemma 2). llama.cpp's
converter does not permute Gemma's q/k rows and stores the norms as ``1 + w``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

from pagedllm.model.llama import LlamaForCausalLM

# transformers' GemmaConfig turns the released configs' "gelu" into the tanh approximation.
_GEMMA_ACTIVATION_ALIASES = {"gelu": "gelu_pytorch_tanh"}


def _gemma_fields(hidden: int) -> dict[str, Any]:
    """What every Gemma 1 config shares, whatever its format."""
    return {"norm_weight_offset": 1.0, "embedding_scale": math.sqrt(hidden)}


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 1 decoder (2B, 7B): Llama layers with ``1 + w`` norms, GeGLU and a scaled
    embedding."""

    gguf_permute_qk: ClassVar[bool] = False

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """Reads ``hidden_act`` ("gelu" meaning the tanh approximation, as in transformers),
        ``attention_bias`` and ``rms_norm_eps`` (default 1e-6). A ``sliding_window`` key is
        ignored, as transformers' Gemma ignores it.

        Raises:
            ValueError: naming ``use_bidirectional_attention`` when it is true (pagedllm runs
                causal decoders only).
        """
        if cfg.get("use_bidirectional_attention"):
            raise ValueError(
                "Gemma with use_bidirectional_attention is not supported (causal decoding only)"
            )
        act = str(cfg.get("hidden_act") or "gelu_pytorch_tanh")
        bias = bool(cfg.get("attention_bias", False))
        return {
            **_gemma_fields(int(cfg["hidden_size"])),
            "hidden_act": _GEMMA_ACTIVATION_ALIASES.get(act, act),
            "attention_bias": bias,
            "o_proj_bias": bias,
            "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
            "sliding_window": None,
            "layer_types": None,
        }

    @classmethod
    def gguf_config_fields(cls, meta: Callable[[str], Any]) -> dict[str, Any]:
        """llama.cpp's gemma keys are the common ones; the activation is fixed (GeGLU)."""
        return {
            **_gemma_fields(int(meta("embedding_length"))),
            "hidden_act": "gelu_pytorch_tanh",
        }
