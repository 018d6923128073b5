"""ERNIE 4.5 dense (Baidu 2025, "ERNIE 4.5 Technical Report"; ``Ernie4_5ForCausalLM``,
``model_type`` ernie4_5, GGUF ``ernie4_5``): the ERNIE-4.5-0.3B decoder.

A Llama (grouped-query attention, SwiGLU MLP, pre-norm RMSNorm layers) with three differences:

* RoPE rotates interleaved pairs of each head's dimensions, (2i, 2i + 1) at frequency i, where
  Llama's rotate-half layout pairs (i, i + D/2). As for Cohere (``layers.interleaved_rope``)
  the q and k projection rows of every head are reordered once at load time, even dimensions
  first: rotate-half RoPE on the reordered rows is the interleaved rotation of the original ones,
  and q and k get the same order, so the attention scores are unchanged. The layers therefore
  stay Llama's and keep the CPU fast path, the one-op C++ layer stack included;
* one switch, ``use_bias``, puts a bias on every projection (q, k, v, o, gate, up, down); the
  released model has none;
* the LM head is tied to the embedding by default (``tie_word_embeddings`` true, as
  transformers), head_dim is the config's (128 in the 0.3B model) and the RoPE base defaults to
  500000.

llama.cpp's ``ernie4_5`` converter splits the original checkpoints' fused qkv / gate-up tensors
and keeps the q/k rows as they are (its graph rotates interleaved pairs itself); this file
reorders them at load as for a Hugging Face folder. The MoE models (``Ernie4_5_MoeForCausalLM``)
are not supported.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from pagedllm.model.layers.interleaved_rope import permute_interleaved_qk
from pagedllm.model.llama import LlamaForCausalLM


class Ernie4_5ForCausalLM(LlamaForCausalLM):  # noqa: N801 (the Hugging Face class name)
    """ERNIE 4.5 dense: Llama layers with interleaved RoPE (a load-time row reorder) and
    ``use_bias`` on every projection."""

    gguf_permute_qk: ClassVar[bool] = False  # llama.cpp keeps the checkpoint's q/k rows
    default_rope_theta: ClassVar[float] = 500000.0
    # q/k rows are reordered at load time: --quantization gguf keeps them float.
    folded_projections: ClassVar[tuple[str, ...]] = ("self_attn.qkv_proj",)

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """Reads ``use_bias`` (biases on q, k, v, o, gate, up and down), the tied head (true by
        default).

        Raises:
            ValueError: naming ``hidden_act`` when it is not SiLU (the model's only one).
        """
        act = str(cfg.get("hidden_act") or "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"ERNIE 4.5 with hidden_act={act!r} is not supported (silu only)")
        bias = bool(cfg.get("use_bias", False))
        fields: dict[str, Any] = {
            "attention_bias": bias,
            "o_proj_bias": bias,
            "mlp_bias": bias,
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        }
        return fields

    @classmethod
    def gguf_config_fields(cls, meta: Any) -> dict[str, Any]:
        """llama.cpp's ``ernie4_5`` keys are the common ones (biases are detected from the
        tensors, the tied head from a missing ``output.weight``)."""
        return {}

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """``DecoderForCausalLM.load_weights``, then every head's q and k rows (and biases)
        reordered for rotate-half RoPE (module docstring), before packing reads them."""
        super().load_weights(state_dict)
        permute_interleaved_qk(self.layers)
