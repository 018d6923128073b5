"""The tiny MoE models of OLMoE, Granite MoE (plain and with a shared expert) and GPT-OSS for the
architecture tests, and how llama.cpp's converters write every tiny MoE model's experts and
MoE keys to GGUF (``arch_utils.write_gguf_like_llama_cpp`` calls these)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from tests.model.arch_utils import GRANITE_MULTIPLIERS, WINDOW

# Test arch name -> llama.cpp's GGUF architecture.
MOE_GGUF_ARCH = {
    "mixtral": "llama",
    "qwen3_moe": "qwen3moe",
    "qwen2_moe": "qwen2moe",
    "olmoe": "olmoe",
    "granitemoe": "granitemoe",
    "granitemoe_shared": "granitemoe",
}
# Granite MoE's tiny models: 8 experts of width 32, top-2; the shared variant adds an ungated
# shared expert of width 48.
GRANITE_MOE_TINY: dict[str, Any] = {
    **GRANITE_MULTIPLIERS,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "intermediate_size": 32,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


def moe_arch_kwargs(arch: str) -> tuple[Any, dict[str, Any]] | None:
    """(transformers model class, extra config kwargs) for the OLMoE / Granite MoE test archs,
    or None for another arch."""
    import transformers as tf

    if arch == "olmoe":  # 8 experts of width 32, top-2, not renormalised (as released)
        return tf.OlmoeForCausalLM, {
            "config": tf.OlmoeConfig,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "norm_topk_prob": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        }
    if arch == "gpt_oss":  # 8 experts of width 32, top-2; window 8 on the even layers
        return tf.GptOssForCausalLM, {
            "config": tf.GptOssConfig,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "sliding_window": WINDOW,
            # 7 in the released models; 1 clamps a good share of the tiny model's gate / up
            # values (tests/model/test_gpt_oss.py checks that it matters).
            "swiglu_limit": 1.0,
            # The released YaRN (factor 32 over 4096 tokens, truncate false), scaled to the tiny
            # model's 256 positions: the ramp ends at a fractional dimension.
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        }
    if arch == "granitemoe":
        return tf.GraniteMoeForCausalLM, {"config": tf.GraniteMoeConfig, **GRANITE_MOE_TINY}
    if arch == "granitemoe_shared":
        return tf.GraniteMoeSharedForCausalLM, {
            "config": tf.GraniteMoeSharedConfig,
            **GRANITE_MOE_TINY,
            "shared_intermediate_size": 48,
        }
    return None


def add_moe_gguf_keys(w: Any, c: Any, arch: str) -> None:
    """The MoE metadata llama.cpp's converter writes for ``arch`` (none for a dense arch): the
    expert counts, and per architecture the experts' width, the shared expert's width and
    whether the top-k weights are renormalised. No sliding window for any of them."""
    if arch not in MOE_GGUF_ARCH:
        return
    w.add_expert_count(getattr(c, "num_local_experts", None) or c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if arch == "qwen3_moe":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_weights_norm(c.norm_topk_prob)
    if arch == "qwen2_moe":  # no expert_weights_norm key: llama.cpp never renormalises Qwen2-MoE
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if arch == "granitemoe_shared":
        w.add_expert_shared_feed_forward_length(c.shared_intermediate_size)


def llama_cpp_moe_tensors(state: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """``state``'s items with transformers' stacked experts as llama.cpp stores them: the router
    (``mlp.gate``; Granite MoE's ``block_sparse_moe.router``) -> ``blk.N.ffn_gate_inp``,
    ``gate_up_proj`` [E, 2I, d] split into ``ffn_gate_exps`` / ``ffn_up_exps`` [E, I, d],
    ``down_proj`` -> ``ffn_down_exps`` [E, d, I]; Granite MoE Shared's fused
    ``shared_mlp.input_linear`` [2S, d] split into ``ffn_gate_shexp`` / ``ffn_up_shexp`` and its
    ``output_linear`` -> ``ffn_down_shexp``."""
    for name, t in state.items():
        parts = name.split(".")
        blk = f"blk.{parts[2]}" if name.startswith("model.layers.") else ""
        if ".experts." in name:
            if name.endswith("gate_up_proj"):
                gate, up = t.chunk(2, dim=1)
                yield f"{blk}.ffn_gate_exps.weight", gate
                yield f"{blk}.ffn_up_exps.weight", up
            else:
                yield f"{blk}.ffn_down_exps.weight", t
        elif name.endswith((".mlp.gate.weight", ".block_sparse_moe.router.weight")):
            yield f"{blk}.ffn_gate_inp.weight", t
        elif name.endswith(".shared_mlp.input_linear.weight"):
            gate, up = t.chunk(2, dim=0)
            yield f"{blk}.ffn_gate_shexp.weight", gate
            yield f"{blk}.ffn_up_shexp.weight", up
        elif name.endswith(".shared_mlp.output_linear.weight"):
            yield f"{blk}.ffn_down_shexp.weight", t
        else:
            yield name, t
