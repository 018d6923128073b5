"""A Llama-style decoder layer as one C++ op (``csrc/cpu/fused_layer.cpp``).

At batch 1 a SmolLM2-135M layer is about fifteen small kernels (two RMSNorms, four GGUF GEMVs,
RoPE, the cache write, decode attention, SiLU, two residual adds); called one by one from Python
they cost ~230 us of module calls, views, allocations and dispatch per layer, about as much as the
GEMVs (issue 22: batch-1 decode against llama.cpp). :class:`FusedDecoderLayer` hands the whole
layer to ``CpuOps.decoder_layer_``, which runs the same kernels back to back, so its outputs are
bit-identical to the unfused path's.

It applies when a layer has the Llama shape (pre-norm, RMSNorm, fused QKV without q/k norms,
RoPE, no soft cap, SwiGLU MLP, no tensor parallelism) and every projection is a kernel the op
knows (``GGUFLinear``, ``PackedLinear`` on pagedllm's own GEMM, ``PackedSwiGLU``); otherwise, and
for any step the C++ attention cannot run (other backend, KV dtype), the layer's Python forward
runs. ``PAGEDLLM_DISABLE_FUSED_LAYER=1`` turns it off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.attention.cpu import CpuPagedAttention
from pagedllm.model.layers.mlp import GatedMLP
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.packed_linear import PackedLinear, PackedSwiGLU
from pagedllm.model.quant.gguf_native import GGUFLinear

if TYPE_CHECKING:
    from pagedllm.model.decoder import StepContext
    from pagedllm.ops import CpuOps

# The op's linear kinds (csrc/cpu/fused_layer.h LinearKind).
KIND_Q4, KIND_Q8, KIND_GEMM, KIND_SWIGLU = 0, 1, 2, 3
# KV cache storages the C++ attention reads and writes (CpuPagedAttention's).
_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn)

_NO_BIAS = torch.empty(0)


def fused_layers_enabled() -> bool:
    """False when ``PAGEDLLM_DISABLE_FUSED_LAYER=1``."""
    return os.environ.get("PAGEDLLM_DISABLE_FUSED_LAYER") != "1"


@dataclass
class _LinearParts:
    weights: list[torch.Tensor]
    kinds: list[int]
    rows: list[int]
    bias: torch.Tensor


def linear_parts(module: nn.Module, gate_up: bool = False) -> _LinearParts | None:
    """The op's description of a projection, or None when it is not a kernel the op runs:
    ``GGUFLinear`` (one part per merged block kind), ``PackedLinear`` on the own GEMM, and for
    ``gate_up`` a ``PackedSwiGLU``."""
    if isinstance(module, GGUFLinear):
        kinds = [KIND_Q4 if p.kind == "q4" else KIND_Q8 for p in module.parts]
        bias = _NO_BIAS if module.bias is None else module.bias
        return _LinearParts(
            [p.data for p in module.parts], kinds, [p.rows for p in module.parts], bias
        )
    if isinstance(module, PackedLinear) and module.gemm_ops is not None:
        bias = _NO_BIAS if module.bias is None else module.bias.float().contiguous()
        return _LinearParts([module.packed], [KIND_GEMM], [module.out_features], bias)
    if gate_up and isinstance(module, PackedSwiGLU):
        return _LinearParts([module.packed], [KIND_SWIGLU], [module.inter], _NO_BIAS)
    return None


class FusedDecoderLayer:
    """The arguments of ``CpuOps.decoder_layer_`` that do not change from step to step, for one
    layer (see the module docstring for when :meth:`build` accepts a layer).

    Call: ``(x [T, d] float32, (key_cache, value_cache), ctx)`` -> ``x`` updated in place, or
    None when this step cannot run fused (the caller then runs the Python forward).
    """

    def __init__(
        self,
        ops: CpuOps,
        input_norm: RMSNorm,
        post_norm: RMSNorm,
        linears: list[_LinearParts],
        heads: tuple[int, int, int, int],
        scale: float,
        window: int,
    ) -> None:
        self.ops = ops
        self.input_norm = input_norm.weight
        self.post_norm = post_norm.weight
        self.eps = float(input_norm.eps)
        self.weights = [w for lin in linears for w in lin.weights]
        self.kinds = [k for lin in linears for k in lin.kinds]
        self.rows = [r for lin in linears for r in lin.rows]
        self.parts = [len(lin.weights) for lin in linears]
        self.biases = [lin.bias for lin in linears]
        self.heads = heads
        self.scale = scale
        self.window = window

    @classmethod
    def build(cls, layer: nn.Module, ops: CpuOps, rotary_dim: int) -> FusedDecoderLayer | None:
        """The fused form of ``layer`` (a ``LlamaDecoderLayer`` after its weights are loaded,
        packed or quantized), or None when some part of it is not one the op runs."""
        attn = getattr(layer, "self_attn", None)
        mlp = getattr(layer, "mlp", None)
        input_norm = getattr(layer, "input_layernorm", None)
        post_norm = getattr(layer, "post_attention_layernorm", None)
        if attn is None or type(mlp) is not GatedMLP or mlp.act not in ("silu", "swish"):
            return None
        if not isinstance(input_norm, RMSNorm) or not isinstance(post_norm, RMSNorm):
            return None
        if torch.float32 != input_norm.weight.dtype or torch.float32 != post_norm.weight.dtype:
            return None
        if attn.q_norm is not None or attn.logits_soft_cap is not None:
            return None
        if input_norm.eps != post_norm.eps:
            return None
        linears = [
            linear_parts(attn.qkv_proj),
            linear_parts(attn.o_proj),
            linear_parts(mlp.gate_up_proj, gate_up=True),
            linear_parts(mlp.down_proj),
        ]
        if any(lin is None for lin in linears):
            return None
        heads = (attn.num_heads, attn.num_kv_heads, attn.head_dim, rotary_dim)
        return cls(
            ops,
            input_norm,
            post_norm,
            [lin for lin in linears if lin is not None],
            heads,
            attn.scale,
            attn.sliding_window or 0,
        )

    def __call__(
        self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor | None:
        backend = ctx.backend
        key_cache, value_cache = kv_cache
        if (
            not isinstance(backend, CpuPagedAttention)
            or not backend.is_native
            or key_cache.dtype not in _CACHE_DTYPES
            or x.dtype != torch.float32
            or x.dim() != 2
            or not x.is_contiguous()
        ):
            return None
        rotary = ctx.rotary_tables("global")
        if rotary is None:
            return None
        meta = ctx.meta
        self.ops.decoder_layer_(
            x,
            self.input_norm,
            self.post_norm,
            self.eps,
            self.weights,
            self.kinds,
            self.rows,
            self.parts,
            self.biases,
            self.heads,
            rotary,
            key_cache,
            value_cache,
            meta.slot_mapping,
            CpuPagedAttention.plan(meta),
            meta.num_decodes,
            meta.num_seqs,
            self.scale,
            backend.partition_size,
            self.window,
        )
        return x
