"""Granite (IBM Granite Team 2024, "Granite 3.0 Language Models"; ``GraniteForCausalLM``,
``model_type`` granite, GGUF ``granite``): the dense Granite 3.x decoders.

A Llama with four scalar multipliers from its maximal-update-style training recipe:

* ``embedding_multiplier``: the embedding output is multiplied by it (``embedding_scale``;
  the tied LM head reads the unscaled embedding matrix);
* ``residual_multiplier``: the attention and MLP outputs are multiplied by it before each
  residual add. It is folded into the o_proj and down_proj weights (and biases) once at load
  time, so the layer stays Llama's and keeps the fused C++ fast path;
* ``attention_multiplier``: the attention softmax scale itself, instead of head_dim ** -0.5
  (``attention_scale``);
* ``logits_scaling``: the logits are divided by it, after the LM head.

llama.cpp's converter writes them as ``granite.embedding_scale``, ``residual_scale``,
``attention.scale`` and ``logit_scale`` (each only when set; an absent attention scale there
means head_dim ** -0.5) and permutes the q/k rows as for Llama. Granite MoE
(``GraniteMoeForCausalLM``) subclasses this model (``granite_moe``); the hybrid Mamba models are
another architecture, not served here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import torch

from pagedllm.model.llama import LlamaDecoderLayer, LlamaForCausalLM


def _multiplier(value: Any) -> float | None:
    """A multiplier as a ``ModelArchConfig`` field: None when absent, 0 or 1 (no-op)."""
    if value is None or float(value) in (0.0, 1.0):
        return None
    return float(value)


def _gguf_float(value: Any) -> float | None:
    """A GGUF float32 value as the shortest decimal that round-trips (0.22, not 0.2199999988),
    so a file and its source config agree; None when absent or 0 (llama.cpp: not set)."""
    if not value:
        return None
    return float(str(np.float32(value)))


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite 3.x dense decoder: Llama layers, with the residual multiplier folded into the
    weights at load time and the logits divided by ``logits_scaling``."""

    folded_projections: ClassVar[tuple[str, ...]] = ("self_attn.o_proj", "mlp.down_proj")

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """Reads the four multipliers (transformers' defaults: 1.0 each, so a config without
        ``attention_multiplier`` scales scores by 1), ``attention_bias`` and ``rms_norm_eps``
        (default 1e-6).

        Raises:
            ValueError: naming ``mlp_bias`` when it is true (no released Granite has MLP
                biases; the fused gate/up kernels take none).
        """
        if cfg.get("mlp_bias"):
            raise ValueError("Granite with mlp_bias is not supported")
        bias = bool(cfg.get("attention_bias", False))
        attention = cfg.get("attention_multiplier")
        return {
            "attention_bias": bias,
            "o_proj_bias": bias,
            "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
            "embedding_scale": _multiplier(cfg.get("embedding_multiplier")),
            "residual_multiplier": _multiplier(cfg.get("residual_multiplier")),
            "attention_scale": 1.0 if attention is None else float(attention),
            "logits_scaling": _multiplier(cfg.get("logits_scaling")),
        }

    @classmethod
    def gguf_config_fields(cls, meta: Callable[[str], Any]) -> dict[str, Any]:
        """llama.cpp's granite keys: ``embedding_scale``, ``residual_scale``,
        ``attention.scale`` (absent: head_dim ** -0.5, as llama.cpp) and ``logit_scale``."""
        return {
            "embedding_scale": _multiplier(_gguf_float(meta("embedding_scale"))),
            "residual_multiplier": _multiplier(_gguf_float(meta("residual_scale"))),
            "attention_scale": _gguf_float(meta("attention.scale")),
            "logits_scaling": _multiplier(_gguf_float(meta("logit_scale"))),
        }

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """``DecoderForCausalLM.load_weights``, then o_proj and down_proj (weights and biases;
        this rank's slices under tensor parallelism) multiplied by ``residual_multiplier`` in
        place, before any packing or quantization reads them."""
        super().load_weights(state_dict)
        scale = self.config.residual_multiplier
        if scale is None:
            return
        with torch.no_grad():
            for layer in self.layers:
                if not isinstance(layer, LlamaDecoderLayer):
                    continue  # a layer another pipeline stage holds
                for param in self.residual_branch_outputs(layer):
                    param.mul_(scale)

    def residual_branch_outputs(self, layer: LlamaDecoderLayer) -> list[torch.Tensor]:
        """The parameters of ``layer`` whose products end a residual branch, so that scaling
        them scales the branch: the weights and biases of ``folded_projections``."""
        return [
            param
            for name in self.folded_projections
            for param in layer.get_submodule(name).parameters(recurse=False)
        ]

    @torch.inference_mode()
    def compute_logits(self, h: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """``DecoderForCausalLM.compute_logits`` divided by ``logits_scaling`` (in place, on the
        float32 logits)."""
        logits = super().compute_logits(h, logits_indices)
        if self.config.logits_scaling is not None:
            logits.div_(self.config.logits_scaling)
        return logits
