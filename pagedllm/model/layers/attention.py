"""Self-attention of a decoder layer over the paged KV cache (vLLM paper section 4).

One fused QKV projection (optionally with bias: Qwen2), optional RMSNorms of queries and keys
before RoPE (per head: Qwen3, Gemma 3; over the whole projection: OLMo 2, OLMoE, whose mean square
spans every rank's heads under tensor parallelism) or per-head LayerNorms with a weight row per
head (Cohere's ``use_qk_norm``, StableLM's ``qk_layernorm``), an optional clamp of q, k and v
(``clip_qkv``: OLMoE; after the q/k norms), the rotary embedding (none on a NoPE layer: SmolLM3), the attention
backend (with the layer's sliding window when it has one: Mistral, Gemma local layers; the
attention-logit soft cap of Gemma 2, on torch_native; GPT-OSS's attention sinks, on every
backend) and the output projection.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention import AttentionBackend, AttentionMetadata
from pagedllm.attention.reference import ReferenceAttention
from pagedllm.attention.torch_native import TorchNativeAttention
from pagedllm.distributed import TensorParallelGroup
from pagedllm.model.config import ModelArchConfig
from pagedllm.model.layers.layer_norm import HeadLayerNorm
from pagedllm.model.layers.linear import column_linear, row_linear
from pagedllm.model.layers.norm import RMSNorm, norm_heads, rms_norm_across_ranks
from pagedllm.model.layers.rotary import Rotate
from pagedllm.model.sharding import TensorParallelShard

_SOFT_CAP_FALLBACK = TorchNativeAttention()


def soft_cap_backend(backend: AttentionBackend) -> TorchNativeAttention | ReferenceAttention:
    """The backend a soft-capped layer (Gemma 2) runs on: ``backend`` itself when it implements
    ``logits_soft_cap`` (reference, torch_native), else torch_native. The C++ CPU and Triton
    kernels have no soft cap (their fused softmax takes raw scaled scores); torch_native reads
    the same KV-cache layout, so only these layers' attention leaves the fast path, the linears,
    norms and rotary stay on it."""
    if isinstance(backend, (TorchNativeAttention, ReferenceAttention)):
        return backend
    return _SOFT_CAP_FALLBACK


def _no_rotation(x: torch.Tensor) -> torch.Tensor:
    return x


class PagedSelfAttention(nn.Module):
    """Multi-head (grouped-query) attention of one layer.

    Args:
        config: architecture (heads, head_dim, biases, q/k norm, window, query scale).
        layer: the layer index (picks the sliding window from ``config.layer_window``).
        dtype: parameter dtype.
        shard: this rank's heads under tensor parallelism, or None.
        group: the tensor-parallel group, or None.

    Attributes:
        sinks: [this rank's query heads] attention-sink logits (``config.attention_sinks``:
            GPT-OSS's ``self_attn.sinks``; cut with the query heads under tensor parallelism),
            or None.

    Forward: x [T, d] -> [T, d] (same dtype), writing the step's K/V into ``kv_cache``.
    """

    def __init__(
        self,
        config: ModelArchConfig,
        layer: int,
        dtype: torch.dtype,
        shard: TensorParallelShard | None = None,
        group: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = shard.num_heads if shard else config.num_attention_heads
        self.num_kv_heads = shard.num_kv_heads if shard else config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = (
            float(config.attention_scale)
            if config.attention_scale is not None
            else float(config.query_pre_attn_scalar or self.head_dim) ** -0.5
        )
        self.sliding_window = config.layer_window(layer)
        #: False on a NoPE layer (``config.nope_layers``): q and k are not rotated.
        self.use_rope = config.layer_uses_rope(layer)
        self.logits_soft_cap = config.attn_logit_softcapping
        hidden = config.hidden_size
        self.qkv_proj = column_linear(
            hidden, self.q_size + 2 * self.kv_size, dtype, bias=config.attention_bias
        )
        self.o_proj = row_linear(self.q_size, hidden, group, dtype, bias=config.o_proj_bias)
        self.q_norm: RMSNorm | HeadLayerNorm | None = None
        self.k_norm: RMSNorm | HeadLayerNorm | None = None
        self.qk_norm_full_width = config.qk_norm_full_width
        self.clip_qkv = config.clip_qkv
        self.group = group
        self.sinks: nn.Parameter | None = None
        if config.attention_sinks:
            self.sinks = nn.Parameter(
                torch.empty(self.num_heads, dtype=dtype), requires_grad=False
            )
        if config.qk_layer_norm:  # this rank's heads' weight rows (Cohere, StableLM)
            eps, d = config.layer_norm_eps, self.head_dim
            self.q_norm = HeadLayerNorm(self.num_heads, d, eps, dtype)
            self.k_norm = HeadLayerNorm(self.num_kv_heads, d, eps, dtype)
        elif config.qk_norm:
            eps, off = config.rms_norm_eps, config.norm_weight_offset
            full = config.qk_norm_full_width  # this rank's heads' slice of the weight
            self.q_norm = RMSNorm(self.q_size if full else self.head_dim, eps, dtype, off)
            self.k_norm = RMSNorm(self.kv_size if full else self.head_dim, eps, dtype, off)

    def clip(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` clamped to [-clip_qkv, clip_qkv] (a new tensor), or ``t`` itself when the
        config has no ``clip_qkv``."""
        if self.clip_qkv is None:
            return t
        return t.clamp(-self.clip_qkv, self.clip_qkv)

    def forward(
        self,
        rotate: Rotate,
        x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t = x.shape[0]
        if not self.use_rope:
            rotate = _no_rotation
        qkv = self.qkv_proj(x)  # [T, (H + 2 KVH) D]
        qs, kvs, d = self.q_size, self.kv_size, self.head_dim
        q_norm, k_norm = self.q_norm, self.k_norm
        if self.qk_norm_full_width and isinstance(q_norm, RMSNorm) and isinstance(k_norm, RMSNorm):
            q_in, k_in = qkv[:, :qs], qkv[:, qs : qs + kvs]
            if self.group is None:
                q_out, k_out = q_norm(q_in), k_norm(k_in)
            else:
                q_out, k_out = rms_norm_across_ranks([q_norm, k_norm], [q_in, k_in], self.group)
            q = rotate(self.clip(q_out).view(t, self.num_heads, d))
            k = rotate(self.clip(k_out).view(t, self.num_kv_heads, d))
        elif q_norm is not None and k_norm is not None:
            q_heads = norm_heads(q_norm, qkv[:, :qs].view(t, self.num_heads, d))
            k_heads = norm_heads(k_norm, qkv[:, qs : qs + kvs].view(t, -1, d))
            q, k = rotate(self.clip(q_heads)), rotate(self.clip(k_heads))
        else:
            # Q and K heads are rotated together: one rotary op per layer.
            qk = rotate(self.clip(qkv[:, : qs + kvs]).view(t, -1, d))
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = self.clip(qkv[:, qs + kvs :]).reshape(t, self.num_kv_heads, d)
        kc, vc = kv_cache
        if self.logits_soft_cap is not None:
            capped = soft_cap_backend(backend)
            o = capped.forward(
                q, k, v, kc, vc, meta, self.scale, self.sliding_window, self.logits_soft_cap,
                sinks=self.sinks,
            )  # fmt: skip
        elif self.sinks is not None:
            o = backend.forward(
                q, k, v, kc, vc, meta, self.scale, self.sliding_window, sinks=self.sinks
            )
        elif self.sliding_window is None:
            o = backend.forward(q, k, v, kc, vc, meta, self.scale)  # [T, H, D]
        else:
            o = backend.forward(q, k, v, kc, vc, meta, self.scale, self.sliding_window)
        return self.o_proj(o.reshape(t, qs))
