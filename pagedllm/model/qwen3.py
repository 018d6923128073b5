"""Qwen3 dense (Qwen team 2025): a Llama with an RMSNorm over each query and key head before RoPE
(``q_norm`` / ``k_norm``, width head_dim) and no QKV bias by default."""

from __future__ import annotations

from typing import Any, ClassVar

from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.qwen2 import gguf_sliding_window, qwen_sliding_window


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama layers with per-head q/k norms (``ModelArchConfig.qk_norm``)."""

    gguf_permute_qk: ClassVar[bool] = False

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """q/k norms, ``attention_bias`` (q/k/v and o; default false) and the sliding window
        as Qwen2's (``qwen2.qwen_sliding_window``: transformers' Qwen3Config has the same
        rule)."""
        bias = bool(cfg.get("attention_bias", False))
        fields = {"qk_norm": True, "attention_bias": bias, "o_proj_bias": bias}
        return {**fields, **qwen_sliding_window(cfg)}

    @classmethod
    def gguf_config_fields(cls, meta: Any) -> dict[str, Any]:
        """q/k norms; the sliding window as Qwen2's (``qwen2.gguf_sliding_window``).

        Raises:
            ValueError: as ``qwen2.gguf_sliding_window``.
        """
        return {"qk_norm": True, **gguf_sliding_window(meta, "Qwen3")}
