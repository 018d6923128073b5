"""What the LayerNorm families share (OPT, GPT-2, GPT-NeoX, Phi-1/1.5/2): LayerNorm with biases,
a non-gated MLP with biases (``make_mlp``), biases on the projections, and either learned
absolute positions (OPT, GPT-2) or (partial) rotary (GPT-NeoX, Phi). Their checkpoints name
tensors differently from Llama; each model file lists regex renames to Llama's Hugging Face names
(``hf_weight_renames``) so that ``model.weight_map`` and ``model.sharding`` serve them unchanged.

Layer variants (``ModelArchConfig``):

* pre-norm (GPT-2, OPT, GPT-NeoX without parallel residual): x + attn(ln1(x)), then
  + mlp(ln2(...));
* parallel residual (GPT-NeoX, GPT-J style; Black et al. 2022 section 2.2):
  x + attn(ln1(x)) + mlp(ln2(x));
* parallel residual over one shared norm (Phi-1/1.5/2, StableLM with ``use_parallel_residual``;
  ``shared_input_norm``): x + attn(ln(x)) + mlp(ln(x)), the layer has no second norm;
* post-norm (OPT-350m, ``do_layer_norm_before`` false; Vaswani et al. 2017):
  ln1(x + attn(x)), then ln2(h + mlp(h)), and no final norm.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from pagedllm.attention import AttentionBackend
from pagedllm.distributed import TensorParallelGroup
from pagedllm.model.config import ModelArchConfig
from pagedllm.model.decoder import DecoderForCausalLM, StepContext
from pagedllm.model.layers.attention import PagedSelfAttention
from pagedllm.model.layers.layer_norm import LayerNorm
from pagedllm.model.layers.plain_mlp import PlainMLP
from pagedllm.model.layers.position_embedding import LearnedPositionEmbedding
from pagedllm.model.layers.rotary import RotaryEmbedding
from pagedllm.model.sharding import TensorParallelShard


def _no_rotation(x: torch.Tensor) -> torch.Tensor:
    return x


class LayerNormDecoderLayer(nn.Module):
    """One block of a LayerNorm decoder (pre-norm, parallel-residual or post-norm, see the module
    docstring).

    Args:
        config: architecture (``parallel_residual``, ``shared_input_norm``, ``norm_before``,
            biases, LayerNorm eps and bias).
        index: layer index.
        dtype: parameter dtype.
        shard / group: tensor-parallel slice and group, or None.

    Forward: h [T, d], the layer's (key_cache, value_cache), the step context -> [T, d]; ``h``
    (this step's own activation) may be overwritten.
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
        d, eps = config.hidden_size, config.layer_norm_eps
        inter = shard.intermediate_size if shard else config.intermediate_size
        self.parallel_residual = config.parallel_residual
        self.norm_before = config.norm_before
        bias = config.layer_norm_bias
        self.input_layernorm = LayerNorm(d, eps, dtype, bias)
        self.self_attn = PagedSelfAttention(config, index, dtype, shard, group)
        self.post_attention_layernorm: LayerNorm | None = None
        if not config.shared_input_norm:
            self.post_attention_layernorm = LayerNorm(d, eps, dtype, bias)
        self.mlp = self.make_mlp(config, inter, dtype, group)

    @staticmethod
    def make_mlp(
        config: ModelArchConfig, inter: int, dtype: torch.dtype, group: TensorParallelGroup | None
    ) -> nn.Module:
        """The feed-forward block, called as ``mlp(x, residual=r)``: here the non-gated
        :class:`PlainMLP` (biases per ``config.mlp_bias``); StableLM's layer returns a gated
        one."""
        return PlainMLP(
            config.hidden_size, inter, config.hidden_act, dtype, group, bias=config.mlp_bias
        )

    def forward(
        self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor:
        rotate = ctx.rotations.get("global", _no_rotation)
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        if not self.norm_before and ln2 is not None:
            h = ln1(x.add_(self.self_attn(rotate, x, kv_cache, ctx.meta, ctx.backend)))
            return ln2(self.mlp(h, residual=h))
        if ln2 is None:  # one norm read by both branches (Phi)
            n = ln1(x)
            a = self.self_attn(rotate, n, kv_cache, ctx.meta, ctx.backend)
            return x.add_(self.mlp(n, residual=a))
        a = self.self_attn(rotate, ln1(x), kv_cache, ctx.meta, ctx.backend)
        if self.parallel_residual:
            # a (a fresh tensor) += mlp(ln2(x)) in the GEMM epilogue, then x += a.
            return x.add_(self.mlp(ln2(x), residual=a))
        x.add_(a)
        return self.mlp(ln2(x), residual=x)


class LayerNormDecoderForCausalLM(DecoderForCausalLM):
    """Base of the LayerNorm model files: the final LayerNorm (none for post-norm models),
    learned positions when ``config.position_offset`` is set (then no RoPE table), and
    checkpoint renaming by the subclass's ``hf_weight_renames`` / ``hf_skip``.

    Raises:
        ValueError: naming ``max_model_len`` when ``max_positions`` exceeds the learned position
            table (``max_position_embeddings``).
    """

    # (pattern, replacement) applied in order with re.sub to each checkpoint tensor name.
    hf_weight_renames: ClassVar[tuple[tuple[str, str], ...]] = ()
    # Checkpoint tensors that are buffers, not weights (matched on the file's name).
    hf_skip: ClassVar[str | None] = None

    def __init__(
        self,
        config: ModelArchConfig,
        dtype: torch.dtype,
        backend: AttentionBackend,
        max_positions: int | None = None,
        group: TensorParallelGroup | None = None,
    ) -> None:
        learned = config.position_offset is not None
        if learned and max_positions and max_positions > config.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({max_positions}) exceeds max_position_embeddings "
                f"({config.max_position_embeddings}): this model's learned position table has "
                "no rows beyond it"
            )
        super().__init__(config, dtype, backend, max_positions, group)
        d = config.hidden_size
        self.norm = (
            LayerNorm(d, config.layer_norm_eps, dtype, config.layer_norm_bias)
            if config.norm_before
            else nn.Identity()
        )
        self.embed_positions: LearnedPositionEmbedding | None = None
        if config.position_offset is not None:
            self.embed_positions = LearnedPositionEmbedding(
                config.max_position_embeddings, d, config.position_offset, dtype
            )
        self.requires_grad_(False)

    layer_class = LayerNormDecoderLayer

    @staticmethod
    def make_rotary(
        config: ModelArchConfig, max_positions: int | None
    ) -> dict[str, RotaryEmbedding]:
        """No RoPE table for learned positions; else the default tables (partial rotary)."""
        if config.position_offset is not None:
            return {}
        return DecoderForCausalLM.make_rotary(config, max_positions)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token embedding plus, with learned positions, the position embedding: [T] -> [T, d]."""
        h = self.embed_tokens(input_ids)
        if self.embed_positions is None:
            return h
        return h.add_(self.embed_positions(positions))

    @classmethod
    def split_gguf_weight(
        cls, name: str, tensor: torch.Tensor, config: ModelArchConfig
    ) -> dict[str, torch.Tensor]:
        """``{name: tensor}``: llama.cpp's converter already undid what ``split_hf_weight``
        undoes (it transposes GPT-2's Conv1D weights and de-interleaves NeoX's per-head QKV
        rows), and the loader splits the fused ``attn_qkv`` itself (``loader.gguf_expand``)."""
        return {name: tensor}

    @classmethod
    def _gguf_layer_norm_fields(cls, meta: Callable[[str], Any]) -> dict[str, Any]:
        """What llama.cpp's GPT-2 / GPT-NeoX files share: no ``attention.key_length`` (head_dim
        = hidden / heads), ``attention.layer_norm_epsilon``, biases on every projection."""
        hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
        eps = meta("attention.layer_norm_epsilon")
        return {
            "head_dim": hidden // heads,
            "layer_norm_eps": 1e-5 if eps is None else float(str(np.float32(eps))),
            "attention_bias": True,
            "o_proj_bias": True,
            "mlp_bias": True,
        }

    @classmethod
    def hf_weight_name(cls, name: str) -> str | None:
        """Llama's Hugging Face name for checkpoint tensor ``name`` (``hf_weight_renames``),
        or None for a buffer matched by ``hf_skip``."""
        if cls.hf_skip is not None and re.search(cls.hf_skip, name):
            return None
        for pattern, repl in cls.hf_weight_renames:
            name = re.sub(pattern, repl, name)
        return name


def split_fused_qkv(
    name: str, t: torch.Tensor, heads: int, per_head: bool
) -> dict[str, torch.Tensor]:
    """Split a fused ``...self_attn.qkv_proj.{weight,bias}`` ([3 H D, ...]) into q/k/v_proj.

    Args:
        name: the renamed tensor name (contains ``.qkv_proj.``).
        t: the fused tensor, rows first.
        heads: H.
        per_head: rows are interleaved per head, [q_h, k_h, v_h] for each head h (GPT-NeoX);
            else [all q; all k; all v] (GPT-2).

    Returns:
        {name with q_proj: [H D, ...], k_proj: ..., v_proj: ...}.
    """
    if per_head:
        parts = t.reshape(heads, 3, -1, *t.shape[1:]).unbind(1)
        q, k, v = (p.reshape(-1, *t.shape[1:]) for p in parts)
    else:
        q, k, v = t.chunk(3, dim=0)
    return {
        name.replace(".qkv_proj.", f".{n}_proj."): x for n, x in zip("qkv", (q, k, v), strict=True)
    }
