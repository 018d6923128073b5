"""GLM-4 (Team GLM 2024, "ChatGLM: A Family of Large Language Models from GLM-130B to GLM-4 All
Tools"): ``GlmForCausalLM`` (``model_type`` glm; glm-4-9b-chat-hf) and its 0414 successor
``Glm4ForCausalLM`` (``model_type`` glm4, GGUF ``glm4``; GLM-4-9B/32B-0414 and the GLM-Z1
reasoning models, Z.ai / THUDM 2025 model cards).

What GLM changes from Llama:

* RoPE turns only part of each head (``partial_rotary_factor``, 0.5 when the config is silent,
  as transformers), and inside that part it rotates interleaved pairs (2i, 2i + 1) at frequency
  i (GPT-J style) where Llama's rotate-half pairs (i, i + R/2). As for Cohere
  (``cohere.interleaved_to_half_order``) the first R rows of every q and k head are permuted once
  at load time, even dimensions then odd ones, the other D - R rows left in place: rotate-half
  on the permuted rows is the interleaved rotation of the original ones, and q and k share the
  permutation, so attention is unchanged. The rotary stays the C++ kernel and the layer stays
  a ``LlamaDecoderLayer`` (the fused per-step op runs it);
* q, k and v have biases by default (``attention_bias``, true in transformers), o_proj none;
* the checkpoint stores gate and up as one ``gate_up_proj`` matrix, split by name at load time
  (``weight_map.split_fused_tensor``, as Phi-3).

GLM-4-0414 adds "sandwich" norms: ``post_self_attn_layernorm`` and ``post_mlp_layernorm`` are
RMSNorms of the attention and MLP outputs before their residual adds (:class:`Glm4DecoderLayer`).

Refused with an error naming the field: a ``partial_rotary_factor`` whose rotary width is odd
(the pairs would not close). llama.cpp's ``glm4`` converter keeps the q/k rows as in the checkpoint
(its graph rotates interleaved pairs), writes the rotary width as ``rope.dimension_count`` and
keeps ``gate_up_proj`` fused as ``ffn_up``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from pagedllm.distributed import TensorParallelGroup
from pagedllm.model.cohere import interleaved_to_half_order
from pagedllm.model.config import ModelArchConfig, hf_rope_parameters
from pagedllm.model.decoder import StepContext
from pagedllm.model.layers.attention import PagedSelfAttention
from pagedllm.model.layers.mlp import GatedMLP
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.sharding import TensorParallelShard
from pagedllm.model.weight_map import split_fused_tensor

# transformers' GlmConfig / Glm4Config default when the config names no factor.
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5


def partial_interleaved_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """[head_dim] int64: the first ``rotary_dim`` dimensions of a head in the order that makes
    rotate-half RoPE equal the interleaved one (``cohere.interleaved_to_half_order``), followed
    by the unrotated ones in place."""
    return torch.cat((interleaved_to_half_order(rotary_dim), torch.arange(rotary_dim, head_dim)))


def permute_partial_head_rows(rows: torch.Tensor, head_dim: int, rotary_dim: int) -> None:
    """Reorder, in place, the rows of each head of ``rows`` ([heads * head_dim, ...]: a q or k
    projection's weight or bias) by :func:`partial_interleaved_order`."""
    order = partial_interleaved_order(head_dim, rotary_dim).to(rows.device)
    view = rows.view(rows.shape[0] // head_dim, head_dim, *rows.shape[1:])
    view.copy_(view[:, order])


def _rotary_fields(partial: float, head_dim: int) -> dict[str, Any]:
    """The partial-rotary field, checked.

    Raises:
        ValueError: naming ``partial_rotary_factor`` when the rotary width is odd or zero.
    """
    rot = int(head_dim * partial)
    if rot <= 0 or rot % 2:
        raise ValueError(
            f"GLM with partial_rotary_factor={partial} (rotary width {rot} of head_dim "
            f"{head_dim}) is not supported: the interleaved pairs need an even, nonzero width"
        )
    return {"partial_rotary_factor": float(partial)}


class GlmForCausalLM(LlamaForCausalLM):
    """glm-4-9b-chat-hf: Llama layers with q/k/v biases, partial interleaved RoPE (a load-time
    row permutation) and a fused ``gate_up_proj`` in the checkpoint."""

    gguf_permute_qk: ClassVar[bool] = False  # llama.cpp's glm4 graph rotates interleaved pairs
    # llama.cpp keeps gate_up_proj fused as ffn_up.
    gguf_tensor_names: ClassVar[dict[str, str]] = {"ffn_up": "mlp.gate_up_proj"}
    splits_hf_weights: ClassVar[bool] = True
    # q/k rows are permuted at load time: --quantization gguf keeps them float.
    folded_projections: ClassVar[tuple[str, ...]] = ("self_attn.qkv_proj",)

    @classmethod
    def split_hf_weight(
        cls, name: str, tensor: torch.Tensor, config: ModelArchConfig
    ) -> dict[str, torch.Tensor]:
        """``gate_up_proj`` -> gate / up (``weight_map.split_fused_tensor``); others unchanged."""
        return split_fused_tensor(name, tensor, config)

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """``attention_bias`` (q, k and v only; true by default as in transformers) and
        ``partial_rotary_factor`` (top level, transformers 4, or in ``rope_parameters``,
        transformers 5; default 0.5), taken out of a non-default RoPE scaling dict.

        Raises:
            ValueError: naming ``partial_rotary_factor`` (see :func:`_rotary_fields`).
        """
        params = cfg.get("rope_parameters") or {}
        partial = cfg.get("partial_rotary_factor", params.get("partial_rotary_factor"))
        partial = DEFAULT_PARTIAL_ROTARY_FACTOR if partial is None else float(partial)
        n_head = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // n_head)
        fields: dict[str, Any] = {
            **_rotary_fields(partial, head_dim),
            "attention_bias": bool(cfg.get("attention_bias", True)),
            "o_proj_bias": False,
            "mlp_bias": False,
        }
        _, scaling = hf_rope_parameters(cfg)
        if scaling is not None:
            scaling.pop("partial_rotary_factor", None)
            fields["rope_scaling"] = scaling
        return fields

    @classmethod
    def gguf_config_fields(cls, meta: Callable[[str], Any]) -> dict[str, Any]:
        """llama.cpp's glm4 keys: ``rope.dimension_count`` is the rotary width (default half the
        head); q/k/v biases are read from the tensors' presence by the loader's common path."""
        n_head = int(meta("attention.head_count"))
        head_dim = int(meta("attention.key_length") or int(meta("embedding_length")) // n_head)
        rotary = meta("rope.dimension_count")
        partial = int(rotary) / head_dim if rotary else DEFAULT_PARTIAL_ROTARY_FACTOR
        return {
            **_rotary_fields(partial, head_dim),
            "head_dim": head_dim,
            "attention_bias": True,
            "o_proj_bias": False,
        }

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """``DecoderForCausalLM.load_weights``, then the rotated q and k rows (weights and
        biases; this rank's heads under tensor parallelism) of every head reordered for
        rotate-half RoPE (module docstring), before any packing or quantization reads them."""
        super().load_weights(state_dict)
        rot = int(self.config.head_dim * self.config.partial_rotary_factor)
        with torch.no_grad():
            for layer in self.layers:
                attn = getattr(layer, "self_attn", None)
                if attn is None:
                    continue  # a layer another pipeline stage holds
                qk_rows = attn.q_size + attn.kv_size
                for param in attn.qkv_proj.parameters(recurse=False):
                    permute_partial_head_rows(param[:qk_rows], attn.head_dim, rot)


class Glm4DecoderLayer(nn.Module):
    """x + post_self_attn_norm(attn(input_norm(x))), then
    + post_mlp_norm(mlp(post_attention_norm(...))) (GLM-4-0414's sandwich norms).

    Args:
        config: architecture.
        index: layer index.
        dtype: parameter dtype.
        shard / group: tensor-parallel slice and group, or None.

    Forward: h [T, d], the layer's (key_cache, value_cache), the step context -> [T, d] (``h``
    updated in place: it is this step's own activation).
    """

    def __init__(
        self,
        config: ModelArchConfig,
        index: int,
        dtype: torch.dtype,
        shard: TensorParallelShard | None = None,
        group: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        inter = shard.intermediate_size if shard else config.intermediate_size
        self.input_layernorm = RMSNorm(d, eps, dtype)
        self.self_attn = PagedSelfAttention(config, index, dtype, shard, group)
        self.post_self_attn_layernorm = RMSNorm(d, eps, dtype)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype)
        self.mlp = GatedMLP(d, inter, config.hidden_act, dtype, group)
        self.post_mlp_layernorm = RMSNorm(d, eps, dtype)

    def forward(
        self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor:
        rotate = ctx.rotations["global"]
        a = self.self_attn(rotate, self.input_layernorm(x), kv_cache, ctx.meta, ctx.backend)
        a = self.post_self_attn_layernorm(a)
        pre = self.post_attention_layernorm
        if pre.cpu_ops is not None and a.dim() == 2:
            # One pass: x += a, a = post_attention_norm(x).
            pre.cpu_ops.fused_add_rms_norm(a, x, pre.weight, pre.eps)
            return x.add_(self.post_mlp_layernorm(self.mlp(a)))
        h = x + a
        return h + self.post_mlp_layernorm(self.mlp(pre(h)))


class Glm4ForCausalLM(GlmForCausalLM):
    """GLM-4-0414 / GLM-Z1: GLM with post-attention and post-MLP RMSNorms on the branches."""

    gguf_tensor_names: ClassVar[dict[str, str]] = {
        "ffn_up": "mlp.gate_up_proj",
        "post_attention_norm": "post_self_attn_layernorm",
        "post_ffw_norm": "post_mlp_layernorm",
    }

    def make_layer(
        self,
        config: ModelArchConfig,
        index: int,
        dtype: torch.dtype,
        shard: TensorParallelShard | None,
        group: TensorParallelGroup | None,
    ) -> nn.Module:
        """A :class:`Glm4DecoderLayer` (Llama's ``layer_class`` is typed as its own layer)."""
        return Glm4DecoderLayer(config, index, dtype, shard, group)
