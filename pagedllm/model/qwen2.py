"""Qwen2 / Qwen2.5 (Qwen team 2024): a Llama whose q, k and v projections have a bias (o_proj has
none). llama.cpp does not permute Qwen's q/k rows."""

from __future__ import annotations

from typing import Any, ClassVar

from pagedllm.model.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama layers with ``attention_bias`` on q/k/v (stacked into the fused QKV bias)."""

    gguf_permute_qk: ClassVar[bool] = False

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        return {"attention_bias": True, "o_proj_bias": False}

    @classmethod
    def gguf_config_fields(cls, meta: Any) -> dict[str, Any]:
        return {"attention_bias": True, "o_proj_bias": False}
