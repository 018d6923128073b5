"""Qwen3 dense (Qwen team 2025): a Llama with an RMSNorm over each query and key head before RoPE
(``q_norm`` / ``k_norm``, width head_dim) and no QKV bias by default."""

from __future__ import annotations

from typing import Any, ClassVar

from pagedllm.model.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama layers with per-head q/k norms (``ModelArchConfig.qk_norm``)."""

    gguf_permute_qk: ClassVar[bool] = False

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        bias = bool(cfg.get("attention_bias", False))
        return {"qk_norm": True, "attention_bias": bias, "o_proj_bias": bias}

    @classmethod
    def gguf_config_fields(cls, meta: Any) -> dict[str, Any]:
        return {"qk_norm": True}
