"""Granite MoE (IBM Granite Team 2024, "Granite 3.0 Language Models", the granite-3.0/3.1
1B-A400M and 3B-A800M MoE models; ``GraniteMoeForCausalLM``, ``model_type`` granitemoe, and
``GraniteMoeSharedForCausalLM``, ``model_type`` granitemoeshared; GGUF ``granitemoe`` for both).

Granite's dense layers (``granite``: the four multipliers, the residual one folded into o_proj and
into every expert's down projection at load time) with every MLP a sparse mixture of SwiGLU
experts (``layers.moe``):

* routing: the router (``block_sparse_moe.router.layer``, [E, hidden]) gives E logits per token;
  the k largest are kept and the softmax is taken over those k only (top-k, then softmax). The
  same experts as the top k of the softmax over all E, with weights equal to renormalised ones
  up to rounding (``route_top_k``);
* experts: a checkpoint stores each layer's experts fused, ``block_sparse_moe.input_linear``
  [E, 2I, hidden] (each expert's gate rows, then its up rows) and ``output_linear``
  [E, hidden, I]. They are split at load time into Mixtral's per-expert names
  (``block_sparse_moe.experts.e.w1`` / ``w3`` / ``w2``), so stacking, CPU packing and
  tensor-parallel slicing are Mixtral's; a tensor-parallel rank reads the fused tensors whole,
  then cuts its slice;
* Granite MoE Shared adds a shared expert without a gate, ``shared_mlp.input_linear``
  [2S, hidden] (gate rows, then up rows) and ``output_linear`` [hidden, S], added to the routed
  experts' sum before the residual multiplier (``layers.moe.SharedExpertMoeBlock`` with
  ``gated`` false).

llama.cpp writes both as ``granitemoe`` (the experts stacked, gate and up split, the shared
expert as ``ffn_*_shexp`` with ``expert_shared_feed_forward_length``; its router takes the
softmax, the top k and renormalises, the same routing up to rounding), with Granite's multiplier
keys and q/k rows permuted as Llama's. The hybrid Mamba models (``GraniteMoeHybridForCausalLM``)
are another architecture, not served here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from gguf.constants import MODEL_TENSOR

from pagedllm.model.config import ModelArchConfig
from pagedllm.model.granite import GraniteForCausalLM
from pagedllm.model.layers.moe import MIXTRAL_NAMES, MoeCheckpointNames, StackedExperts
from pagedllm.model.llama import LlamaDecoderLayer
from pagedllm.model.loader.gguf_loader import gguf_layer_tensor
from pagedllm.model.mixtral import MixtralForCausalLM

# Checkpoint tensors (after ``hf_weight_name``) that ``split_hf_weight`` cuts into several.
_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.(input|output)_linear\.weight$")
_FUSED_SHARED = re.compile(r"^(model\.layers\.\d+\.)shared_mlp\.(input|output)_linear\.weight$")


class GraniteMoeForCausalLM(GraniteForCausalLM, MixtralForCausalLM):
    """Granite MoE (and Granite MoE Shared): Granite's multipliers on Mixtral's MoE layers, routed
    top-k then softmax; the fused expert tensors are split into per-expert ones at load time."""

    moe_names: ClassVar[MoeCheckpointNames] = MIXTRAL_NAMES
    splits_hf_weights: ClassVar[bool] = True
    default_rope_theta: ClassVar[float] = 10000.0  # (Mixtral's is 1e6)
    # Under --quantization gguf these keep the multiplier folded into their float weights.
    folded_projections: ClassVar[tuple[str, ...]] = (
        "self_attn.o_proj",
        "mlp.down_proj",
        "mlp.shared_expert.down_proj",
    )
    gguf_tensor_names: ClassVar[dict[str, str]] = {
        gguf_layer_tensor(MODEL_TENSOR.FFN_GATE_SHEXP): "mlp.shared_expert.gate_proj",
        gguf_layer_tensor(MODEL_TENSOR.FFN_UP_SHEXP): "mlp.shared_expert.up_proj",
        gguf_layer_tensor(MODEL_TENSOR.FFN_DOWN_SHEXP): "mlp.shared_expert.down_proj",
    }

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """Granite's fields (the four multipliers, ``attention_bias``, ``rms_norm_eps``), the
        experts (``num_local_experts``, ``num_experts_per_tok``, width ``intermediate_size``),
        top-k-then-softmax routing and Granite MoE Shared's ungated
        ``shared_intermediate_size`` (0 or absent: none).

        Raises:
            ValueError: naming ``mlp_bias`` (as Granite) or ``num_local_experts`` when the config
                has no experts.
        """
        experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
        if experts < 1:
            raise ValueError("Granite MoE config.json needs num_local_experts >= 1")
        shared = int(cfg.get("shared_intermediate_size") or 0)
        return {
            **super().hf_config_fields(cfg),
            "num_experts": experts,
            "num_experts_per_tok": int(cfg.get("num_experts_per_tok", 2)),
            "norm_topk_prob": True,  # the softmax over the k logits sums to 1
            "router_top_k_then_softmax": True,
            "shared_expert_intermediate_size": shared or None,
            "shared_expert_gated": False,
        }

    @classmethod
    def gguf_config_fields(cls, meta: Callable[[str], Any]) -> dict[str, Any]:
        """Granite's multiplier keys plus ``expert_count``, ``expert_used_count`` and
        ``expert_shared_feed_forward_length``; the experts' width is ``feed_forward_length``."""
        shared = int(meta("expert_shared_feed_forward_length") or 0)
        return {
            **super().gguf_config_fields(meta),
            "num_experts": int(meta("expert_count") or 0),
            "num_experts_per_tok": int(meta("expert_used_count") or 2),
            "norm_topk_prob": True,
            "router_top_k_then_softmax": True,
            "shared_expert_intermediate_size": shared or None,
            "shared_expert_gated": False,
        }

    @classmethod
    def hf_weight_name(cls, name: str) -> str | None:
        """The router ``block_sparse_moe.router.layer.weight`` (or transformers' in-memory
        ``router.weight``) -> ``block_sparse_moe.gate.weight``; transformers' in-memory fused
        expert names (``experts.gate_up_proj`` / ``experts.down_proj``) -> the checkpoint's
        ``input_linear`` / ``output_linear``; the rest unchanged."""
        for old, new in (
            (".block_sparse_moe.router.layer.weight", ".block_sparse_moe.gate.weight"),
            (".block_sparse_moe.router.weight", ".block_sparse_moe.gate.weight"),
            (".block_sparse_moe.experts.gate_up_proj", ".block_sparse_moe.input_linear.weight"),
            (".block_sparse_moe.experts.down_proj", ".block_sparse_moe.output_linear.weight"),
        ):
            if name.endswith(old):
                return name[: -len(old)] + new
        return name

    @classmethod
    def split_hf_weight(
        cls, name: str, tensor: torch.Tensor, config: ModelArchConfig
    ) -> dict[str, torch.Tensor]:
        """The fused experts as per-expert tensors (views): ``input_linear`` [E, 2I, d] ->
        ``experts.e.w1`` (rows :I) and ``experts.e.w3`` (rows I:), ``output_linear``
        [E, d, I] -> ``experts.e.w2``; the shared expert's ``input_linear`` [2S, d] ->
        ``mlp.shared_expert.gate_proj`` / ``up_proj``, ``output_linear`` -> ``down_proj``.

        Raises:
            ValueError: naming the tensor when its shape does not fit the config's experts.
        """
        m = _FUSED_EXPERTS.match(name)
        if m is not None:
            prefix, kind = m.group(1), m.group(2)
            if tensor.dim() != 3 or tensor.shape[0] != config.num_experts:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}; expected "
                    f"[{config.num_experts}, out, in] (num_local_experts experts)"
                )
            base = f"{prefix}block_sparse_moe.experts."
            out: dict[str, torch.Tensor] = {}
            for e in range(config.num_experts):
                if kind == "output":
                    out[f"{base}{e}.w2.weight"] = tensor[e]
                else:
                    gate, up = _halves(name, tensor[e])
                    out[f"{base}{e}.w1.weight"], out[f"{base}{e}.w3.weight"] = gate, up
            return out
        m = _FUSED_SHARED.match(name)
        if m is not None:
            base = f"{m.group(1)}mlp.shared_expert."
            if m.group(2) == "output":
                return {f"{base}down_proj.weight": tensor}
            gate, up = _halves(name, tensor)
            return {f"{base}gate_proj.weight": gate, f"{base}up_proj.weight": up}
        return {name: tensor}

    def residual_branch_outputs(self, layer: LlamaDecoderLayer) -> list[torch.Tensor]:
        """What Granite's ``load_weights`` scales by the residual multiplier in a MoE layer:
        o_proj, every expert's down projection and the shared expert's (the MoE block's output
        is what the multiplier scales); a dense layer's as Granite's."""
        experts = getattr(layer.mlp, "experts", None)
        names = ["self_attn.o_proj"]
        params: list[torch.Tensor] = []
        if not isinstance(experts, StackedExperts):
            names.append("mlp.down_proj")
        else:
            params.append(experts.down_weight)
            if getattr(layer.mlp, "shared_expert", None) is not None:
                names.append("mlp.shared_expert.down_proj")
        for name in names:
            params += layer.get_submodule(name).parameters(recurse=False)
        return params


def _halves(name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate rows, up rows) of a fused [2I, d] tensor.

    Raises:
        ValueError: naming the tensor when its rows are odd.
    """
    if tensor.shape[0] % 2:
        raise ValueError(f"weight {name!r}: {tensor.shape[0]} rows cannot be gate and up halves")
    gate, up = tensor.chunk(2, dim=0)
    return gate, up
