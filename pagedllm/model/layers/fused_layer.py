"""The decoder layers of a step as one C++ op (``csrc/cpu/fused_layer.cpp``).

At batch 1 a SmolLM2-135M layer is about fifteen small kernels (two RMSNorms, four GGUF GEMVs,
RoPE, the cache write, decode attention, SiLU, two residual adds); called one by one from Python
they cost ~230 us of module calls, views, allocations and dispatch per layer, about as much as the
GEMVs (issue 22: batch-1 decode against llama.cpp). :class:`FusedDecoderStack` hands all the
layers to ``CpuOps.decoder_layers_``, which runs the same kernels back to back, so its outputs are
bit-identical to the unfused path's.

It applies when every layer has the Llama shape (pre-norm, RMSNorm, fused QKV without q/k norms,
RoPE or none at all (a NoPE layer: SmolLM3), no soft cap, SwiGLU MLP, no tensor parallelism) and
every projection is a kernel the op knows (``GGUFLinear``, ``PackedLinear`` on pagedllm's own GEMM
or on oneDNN, ``PackedSwiGLU``, ``Int8Linear`` on the C++ int8 GEMM); otherwise, and for any step the C++ attention cannot run
(other backend, KV dtype), the layers' Python forward runs. ``PAGEDLLM_DISABLE_FUSED_LAYER=1``
turns it off.
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
from pagedllm.model.quant.int8 import Int8Linear
from pagedllm.model.step_interrupt import StepInterrupt, StepInterrupted

if TYPE_CHECKING:
    from pagedllm.model.decoder import StepContext
    from pagedllm.ops import CpuOps

# The op's linear kinds (csrc/cpu/fused_layer.h LinearKind).
KIND_Q4, KIND_Q8, KIND_GEMM, KIND_SWIGLU, KIND_INT8, KIND_ONEDNN = 0, 1, 2, 3, 4, 5
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
    ``GGUFLinear`` (one part per merged block kind), ``PackedLinear`` (own GEMM panels, or
    oneDNN's packed weight: bf16 on AMX CPUs, where the op runs oneDNN's AMX matmul and keeps the
    rest of the layer in C++), ``Int8Linear`` on the C++ int8 GEMM, and for ``gate_up`` a
    ``PackedSwiGLU``."""
    if isinstance(module, GGUFLinear):
        kinds = [KIND_Q4 if p.kind == "q4" else KIND_Q8 for p in module.parts]
        bias = _NO_BIAS if module.bias is None else module.bias
        return _LinearParts(
            [p.data for p in module.parts], kinds, [p.rows for p in module.parts], bias
        )
    if isinstance(module, PackedLinear):
        bias = _NO_BIAS if module.bias is None else module.bias.float().contiguous()
        kind = KIND_ONEDNN if module.gemm_ops is None else KIND_GEMM
        return _LinearParts([module.packed], [kind], [module.out_features], bias)
    if gate_up and isinstance(module, PackedSwiGLU):
        return _LinearParts([module.packed], [KIND_SWIGLU], [module.inter], _NO_BIAS)
    if type(module) is Int8Linear and module.record is not None:  # not the row-parallel one
        bias = _NO_BIAS if module.bias is None else module.bias
        return _LinearParts([module.record], [KIND_INT8], [module.out_features], bias)
    return None


class FusedDecoderLayer:
    """One layer's part of the ``CpuOps.decoder_layers_`` arguments (see the module docstring
    for when :meth:`build` accepts a layer).

    Attributes:
        norms: (input, post-attention) RMSNorm weights [d] float32.
        linears: qkv, o, gate_up, down as the op's parts.
        shape: (eps, num_heads, num_kv_heads, head_dim, scale): equal across the layers of one
            stack.
        window: sliding window (0: none).
        rotary_dim: dimensions of each q / k head that RoPE turns (0: a NoPE layer).
    """

    def __init__(
        self,
        norms: tuple[torch.Tensor, torch.Tensor],
        linears: list[_LinearParts],
        shape: tuple[float, int, int, int, float],
        window: int,
        rotary_dim: int,
    ) -> None:
        self.norms = norms
        self.linears = linears
        self.shape = shape
        self.window = window
        self.rotary_dim = rotary_dim

    @classmethod
    def build(cls, layer: nn.Module, rotary_dim: int) -> FusedDecoderLayer | None:
        """The fused form of ``layer`` (a ``LlamaDecoderLayer`` after its weights are loaded,
        packed or quantized; ``rotary_dim``: the model's RoPE width, which a NoPE layer replaces
        by 0), or None when some part of it is not one the op runs."""
        from pagedllm.model.llama import LlamaDecoderLayer  # the forward the op reproduces

        if type(layer) is not LlamaDecoderLayer:
            return None
        attn = getattr(layer, "self_attn", None)
        mlp = getattr(layer, "mlp", None)
        input_norm = getattr(layer, "input_layernorm", None)
        post_norm = getattr(layer, "post_attention_layernorm", None)
        if attn is None or type(mlp) is not GatedMLP or mlp.act not in ("silu", "swish"):
            return None
        if not isinstance(input_norm, RMSNorm) or not isinstance(post_norm, RMSNorm):
            return None
        norm_dtypes = {input_norm.weight.dtype, post_norm.weight.dtype}
        if not norm_dtypes <= {torch.float32, torch.bfloat16}:
            return None
        if attn.q_norm is not None or attn.logits_soft_cap is not None:
            return None
        if attn.sinks is not None:  # the op's attention calls take no sinks
            return None
        if attn.clip_qkv is not None:  # the op has no clamp of q / k / v
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
        shape = (
            float(input_norm.eps),
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            float(attn.scale),
        )
        parts = [lin for lin in linears if lin is not None]
        norms = (input_norm.weight.float(), post_norm.weight.float())  # the op's norms are fp32
        rotary = rotary_dim if attn.use_rope else 0
        return cls(norms, parts, shape, attn.sliding_window or 0, rotary)


class FusedDecoderStack:
    """The layers of a model (or of a pipeline stage) as one ``CpuOps.decoder_layers_`` call.

    Args:
        ops: the C++ CPU kernels.
        layers: each layer's :class:`FusedDecoderLayer`, in order.

    Raises:
        ValueError: the layers differ in eps, heads, head size or scale.

    Call: ``(h [T, d] float32 contiguous, kv caches per layer, ctx, interrupt)`` -> True when
    ``h`` was run through every layer in place, False when this step cannot run fused (another
    attention backend or KV dtype, another activation layout): the caller then runs the layers'
    Python forward. With an ``interrupt`` (``model.step_interrupt.StepInterrupt``) another thread
    may stop the call between layers: it then raises ``StepInterrupted``.
    """

    def __init__(self, ops: CpuOps, layers: list[FusedDecoderLayer]) -> None:
        shapes = {layer.shape for layer in layers}
        if len(shapes) != 1:
            raise ValueError(f"layers: the fused layers differ in shape {sorted(shapes)}")
        eps, heads, kv_heads, head_dim, scale = shapes.pop()
        lins = [lin for layer in layers for lin in layer.linears]
        self.ops = ops
        self.num_layers = len(layers)
        self.layer_args = (
            [n for layer in layers for n in layer.norms],
            eps,
            [w for lin in lins for w in lin.weights],
            [k for lin in lins for k in lin.kinds],
            [r for lin in lins for r in lin.rows],
            [len(lin.weights) for lin in lins],
            [lin.bias for lin in lins],
            [layer.window for layer in layers],
            heads,
            kv_heads,
            head_dim,
            [layer.rotary_dim for layer in layers],
            scale,
        )

    def __call__(
        self,
        h: torch.Tensor,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        ctx: StepContext,
        interrupt: StepInterrupt | None = None,
    ) -> bool:
        backend = ctx.backend
        if (
            len(kv) != self.num_layers
            or not isinstance(backend, CpuPagedAttention)
            or not backend.is_native
            or kv[0][0].dtype not in _CACHE_DTYPES
            or h.dtype != torch.float32
            or h.dim() != 2
            or not h.is_contiguous()
        ):
            return False
        rotary = ctx.rotary_tables("global")
        if rotary is None:
            return False
        meta = ctx.meta
        tables, seq_lens, starts = CpuPagedAttention.plan(meta)
        step_args = (
            *rotary,
            meta.slot_mapping,
            tables,
            seq_lens,
            starts,
            meta.num_decodes,
            meta.num_seqs,
            backend.partition_size,
        )
        keys, values = [k for k, _ in kv], [v for _, v in kv]
        flag = None if interrupt is None else interrupt.flag
        self.ops.decoder_layers_(h, keys, values, self.layer_args, step_args, flag)
        if interrupt is not None and interrupt.stopped_early(self.num_layers):
            raise StepInterrupted(f"stopped before layer {int(interrupt.flag[1])}")
        return True
