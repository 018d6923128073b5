"""Qwen2-MoE (Qwen team 2024: the Qwen1.5-MoE-A2.7B release, "Qwen1.5-MoE: Matching 7B Model
Performance with 1/3 Activated Parameters", and the Qwen2 Technical Report, arXiv:2407.10671,
section 2.2.3, for Qwen2-57B-A14B; ``Qwen2MoeForCausalLM``, ``model_type`` qwen2_moe, GGUF
``qwen2moe``).

Qwen2's attention (q, k and v projections with a bias, o_proj without; ``qkv_bias``) with sparse
mixture-of-experts MLPs as Qwen3-MoE's: softmax router, top-k of E SwiGLU experts of width
``moe_intermediate_size``, the k weights renormalised only when ``norm_topk_prob`` (false in the
released models); layers listed in ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid keep
a dense MLP of ``intermediate_size``. Every MoE layer also has a shared expert, a SwiGLU MLP of
``shared_expert_intermediate_size`` that every token runs, its output multiplied per token by
``sigmoid(shared_expert_gate(x))`` ([1, hidden] weight) and added to the routed experts' sum
(``layers.moe.SharedExpertMoeBlock``). Under tensor parallelism the shared expert is split like a
dense MLP and its gate is replicated.

Sliding window: honoured when ``use_sliding_window`` is set and ``config.json`` lists the
``layer_types`` (transformers 5 writes them). Without them the windowed layers would have to be
derived from ``max_window_layers``, which transformers versions have done differently, so such a
config is refused with a ``ValueError`` naming ``use_sliding_window``. A GGUF file's window is
read from ``attention.sliding_window`` with a per-layer ``attention.sliding_window_pattern``
(``qwen2.gguf_sliding_window``, as for the dense models).
"""

from __future__ import annotations

from typing import Any, ClassVar

from gguf.constants import MODEL_TENSOR

from pagedllm.model.loader.gguf_loader import gguf_layer_tensor
from pagedllm.model.qwen2 import gguf_sliding_window
from pagedllm.model.qwen3_moe import Qwen3MoeForCausalLM


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen3-MoE's layers without q/k norms, with Qwen2's QKV bias and a gated shared expert in
    every MoE layer."""

    gguf_tensor_names: ClassVar[dict[str, str]] = {
        gguf_layer_tensor(MODEL_TENSOR.FFN_GATE_SHEXP): "mlp.shared_expert.gate_proj",
        gguf_layer_tensor(MODEL_TENSOR.FFN_UP_SHEXP): "mlp.shared_expert.up_proj",
        gguf_layer_tensor(MODEL_TENSOR.FFN_DOWN_SHEXP): "mlp.shared_expert.down_proj",
        gguf_layer_tensor(MODEL_TENSOR.FFN_GATE_INP_SHEXP): "mlp.shared_expert_gate",
    }

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """Qwen3-MoE's expert fields, ``qkv_bias`` (default true) and
        ``shared_expert_intermediate_size``.

        Raises:
            ValueError: naming ``use_sliding_window`` when it is set without ``layer_types``.
        """
        if cfg.get("use_sliding_window") and not cfg.get("layer_types"):
            raise ValueError(
                "Qwen2-MoE with use_sliding_window and no layer_types in config.json is not "
                "supported (which layers are windowed depends on the transformers version's "
                "reading of max_window_layers); list the layer_types"
            )
        fields = super().hf_config_fields(cfg)
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        return {
            **fields,
            "qk_norm": False,
            "attention_bias": bool(cfg.get("qkv_bias", True)),
            "o_proj_bias": False,
            "shared_expert_intermediate_size": shared or None,
        }

    @classmethod
    def gguf_config_fields(cls, meta: Any) -> dict[str, Any]:
        """llama.cpp's ``qwen2moe`` keys: ``expert_count``, ``expert_used_count``,
        ``expert_feed_forward_length``, ``expert_shared_feed_forward_length`` and
        ``expert_weights_norm`` (absent: not renormalised, as llama.cpp runs Qwen2-MoE); the
        sliding window per ``qwen2.gguf_sliding_window``.

        Raises:
            ValueError: as ``qwen2.gguf_sliding_window``.
        """
        norm = meta("expert_weights_norm")
        width = meta("expert_feed_forward_length") or meta("feed_forward_length")
        shared = int(meta("expert_shared_feed_forward_length") or 0)
        return {
            "attention_bias": True,
            "o_proj_bias": False,
            "num_experts": int(meta("expert_count") or 0),
            "num_experts_per_tok": int(meta("expert_used_count") or 4),
            "moe_intermediate_size": int(width),
            "norm_topk_prob": False if norm is None else bool(norm),
            "shared_expert_intermediate_size": shared or None,
            **gguf_sliding_window(meta, "Qwen2-MoE"),
        }
