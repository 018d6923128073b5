"""OLMoE (Muennighoff et al. 2024, "OLMoE: Open Mixture-of-Experts Language Models",
arXiv:2409.02060, section 2; ``OlmoeForCausalLM``, ``model_type`` olmoe, GGUF ``olmoe``).

A pre-norm Llama decoder (grouped-query attention with RoPE, RMSNorm before attention and before
the feed-forward block) in which:

* queries and keys get an RMSNorm over the whole projection before RoPE, as OLMo 2's (width
  ``heads * head_dim`` for q, ``kv_heads * head_dim`` for k; one mean square per token, not per
  head; under tensor parallelism the sums of squares are all-reduced over the ranks' heads);
* every feed-forward block is a sparse mixture of experts without a shared expert: a softmax
  router over E SwiGLU experts (64 in OLMoE-1B-7B), each token's top k (8) weighted by their
  probabilities, renormalised only when ``norm_topk_prob`` (false in the released models);
* with ``clip_qkv`` set, q, k and v are clamped to [-clip_qkv, clip_qkv] after the projection
  and after the q/k norms, before RoPE (as transformers' OlmoeAttention; the released models set
  none).

Checkpoints name the experts as Qwen-MoE does (``mlp.experts.N.{gate,up,down}_proj``, router
``mlp.gate``). llama.cpp's ``olmoe`` files: q/k rows not permuted, the top-k weights not
renormalised unless ``expert_weights_norm`` says so, ``attention.clamp_kqv`` read as ``clip_qkv``
when a file has it (llama.cpp's converter writes none for OLMoE).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from pagedllm.model.layers.moe import QWEN_MOE_NAMES, MoeCheckpointNames
from pagedllm.model.mixtral import MixtralForCausalLM


def _clip_qkv(value: Any) -> float | None:
    """``clip_qkv`` as a config field: None when absent; a positive float otherwise.

    Raises:
        ValueError: naming ``clip_qkv`` when it is not positive (the clamp would be empty).
    """
    if value is None:
        return None
    if float(value) <= 0:
        raise ValueError(f"OLMoE clip_qkv must be positive, got {value}")
    return float(value)


class OlmoeForCausalLM(MixtralForCausalLM):
    """OLMoE decoder: Llama's pre-norm layers with full-width q/k norms, an optional q/k/v clamp
    and a sparse MoE block in every layer."""

    gguf_permute_qk: ClassVar[bool] = False
    moe_names: ClassVar[MoeCheckpointNames] = QWEN_MOE_NAMES
    default_rope_theta: ClassVar[float] = 10000.0  # (Mixtral's is 1e6)

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """Full-width q/k norms, ``clip_qkv``, ``attention_bias`` (q, k, v and o), the experts
        (``num_experts``, or ``num_local_experts``; ``num_experts_per_tok``, default 8) and
        ``norm_topk_prob`` (default false).

        Raises:
            ValueError: naming ``clip_qkv`` when it is not positive.
        """
        bias = bool(cfg.get("attention_bias", False))
        return {
            "qk_norm": True,
            "qk_norm_full_width": True,
            "clip_qkv": _clip_qkv(cfg.get("clip_qkv")),
            "attention_bias": bias,
            "o_proj_bias": bias,
            "num_experts": int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0),
            "num_experts_per_tok": int(cfg.get("num_experts_per_tok", 8)),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        }

    @classmethod
    def gguf_config_fields(cls, meta: Callable[[str], Any]) -> dict[str, Any]:
        """llama.cpp's ``olmoe`` keys: ``expert_count``, ``expert_used_count``,
        ``expert_weights_norm`` (absent: not renormalised, as llama.cpp runs OLMoE) and
        ``attention.clamp_kqv``; the experts' width is ``feed_forward_length``."""
        norm = meta("expert_weights_norm")
        return {
            "qk_norm": True,
            "qk_norm_full_width": True,
            "clip_qkv": _clip_qkv(meta("attention.clamp_kqv") or None),
            "num_experts": int(meta("expert_count") or 0),
            "num_experts_per_tok": int(meta("expert_used_count") or 8),
            "norm_topk_prob": False if norm is None else bool(norm),
        }
