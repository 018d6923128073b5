"""Vectorized PyTorch paged attention: the portable backend (CPU or CUDA, any dtype).

It is what "auto" falls back to when the C++ CPU extension cannot be built or Triton cannot run on
the CUDA device, and what ``CpuPagedAttention`` uses for dtypes its kernels lack (float16). Every
tensor it creates is on the device of the KV cache.

Decodes (one new token per sequence) are done together: their blocks are gathered through the
block tables with one ``index_select`` per layer into a padded [KVH, S, L, D] tensor (contiguous
thanks to the head-first cache layout), then two batched matmuls with an additive padding mask.
Prefill sequences are done one at a time with ``scaled_dot_product_attention`` over the gathered
context with a causal mask offset by the cached length (so prefix hits and chunks work). SDPA has
neither a soft cap (Gemma 2) nor attention sinks (gpt-oss): prefills with either materialize the
scores (``_explicit_attention``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.kv_quant import gather_blocks
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.reference import write_kv


class TorchNativeAttention:
    """Paged attention with torch ops only. See ``reference.paged_attention_reference`` for the
    contract; results agree with it to float32 rounding."""

    name = "torch_native"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        *,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write K/V of the new tokens, then attend.

        Args:
            query: [T, H, D]; key, value: [T, KVH, D].
            key_cache, value_cache: [KVH, num_blocks, block_size, D], same dtype and device; or
                quantized int8 / fp8 (``kv_quant``: dequantized as their blocks are gathered).
            meta: batch layout; its index tensors (int64) on the same device.
            scale: softmax scale.
            sliding_window: when set, position p attends to keys p - window + 1 .. p only.
            logits_soft_cap: when set, scaled scores become ``cap * tanh(scores / cap)`` before
                the mask and softmax (Gemma 2); prefills then take the explicit-softmax path.
            sinks: [H] attention-sink logits (gpt-oss), or None: each head's softmax also runs
                over its sink, a key of value zero (``reference.paged_attention_reference``);
                prefills then take the explicit-softmax path.

        Returns:
            [T, H, D], dtype and device of ``query``.
        """
        write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        if sliding_window is not None and max(meta.seq_lens_list) <= sliding_window:
            sliding_window = None  # every key is inside the window: plain causal attention
        nd = meta.num_decodes
        w, cap = sliding_window, logits_soft_cap
        if nd == meta.num_seqs:
            return self._decode(query, key_cache, value_cache, meta, scale, w, cap, sinks)
        out = torch.empty_like(query)
        if nd:
            out[:nd] = self._decode(
                query[:nd], key_cache, value_cache, meta, scale, w, cap, sinks
            )
        starts = meta.query_start_loc_list
        for i in range(nd, meta.num_seqs):
            lo, hi = starts[i], starts[i + 1]
            q = query[lo:hi]
            out[lo:hi] = self._prefill(q, key_cache, value_cache, meta, i, scale, w, cap, sinks)
        return out

    @staticmethod
    def _decode_plan(
        meta: AttentionMetadata, dtype: torch.dtype, window: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Once per step (and window): flat block ids to gather and the additive mask
        [1, S, 1, L] hiding padding and, with ``window``, keys before the window."""
        key = "decode" if window is None else f"decode/{window}"
        plan = meta.backend_cache.get(key)
        if plan is None:
            nd = meta.num_decodes
            bs = meta.block_size
            nb = -(-max(meta.seq_lens_list[:nd]) // bs)
            index = meta.block_tables[:nd, :nb].reshape(-1)
            length = nb * bs
            dev = meta.seq_lens.device
            pos = torch.arange(length, device=dev)
            pad = pos >= meta.seq_lens[:nd, None]  # [S, L]
            if window is not None:
                pad |= pos <= meta.seq_lens[:nd, None] - 1 - window
            bias = torch.zeros(nd, length, dtype=dtype, device=dev).masked_fill_(pad, float("-inf"))
            plan = (index, bias.view(1, nd, 1, length), length)
            meta.backend_cache[key] = plan
        return plan

    def _decode(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        nd, h, d = q.shape
        kvh = key_cache.shape[0]
        g = h // kvh
        index, bias, length = self._decode_plan(meta, q.dtype, window)
        # [KVH, NB, BS, D] -> [KVH, S * nb, BS, D] -> [KVH * S, L, D], contiguous, one copy.
        k = gather_blocks(key_cache, index, q.dtype).view(kvh * nd, length, d)
        v = gather_blocks(value_cache, index, q.dtype).view(kvh * nd, length, d)
        qg = q.view(nd, kvh, g, d).transpose(0, 1).reshape(kvh * nd, g, d)
        scores = torch.bmm(qg, k.transpose(1, 2)).view(kvh, nd, g, length)
        scores = scores.mul_(scale)
        if cap is not None:
            scores = scores.div_(cap).tanh_().mul_(cap)
        scores = scores.add_(bias)
        if sinks is None:
            probs = torch.softmax(scores, dim=-1).view(kvh * nd, g, length)
        else:  # one more column per head, the sink's; dropped after the softmax (no value)
            sink = sinks.to(scores.dtype).view(kvh, 1, g, 1).expand(kvh, nd, g, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)
            probs = probs[..., :length].reshape(kvh * nd, g, length)
        o = torch.bmm(probs, v).view(kvh, nd, g, d)  # [KVH, S, G, D]
        return o.transpose(0, 1).reshape(nd, h, d)

    def _prefill(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        i: int,
        scale: float,
        window: int | None = None,
        cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ctx = meta.seq_lens_list[i]
        ql = q.shape[0]
        kvh, d = key_cache.shape[0], key_cache.shape[3]
        nb = -(-ctx // meta.block_size)
        index = meta.block_tables[i, :nb]
        length = nb * meta.block_size
        k = gather_blocks(key_cache, index, q.dtype).view(1, kvh, length, d)[:, :, :ctx]
        v = gather_blocks(value_cache, index, q.dtype).view(1, kvh, length, d)[:, :, :ctx]
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
        if ql == ctx and window is None and cap is None and sinks is None:
            o = F.scaled_dot_product_attention(
                qh, k, v, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            # Query t sits at position ctx - ql + t and sees keys 0 .. that position (only the
            # last ``window`` of them with a sliding window).
            q_pos = torch.arange(ctx - ql, ctx, device=q.device)[:, None]
            k_pos = torch.arange(ctx, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            if cap is None and sinks is None:
                o = F.scaled_dot_product_attention(
                    qh, k, v, attn_mask=mask, scale=scale, enable_gqa=True
                )
            else:
                o = _explicit_attention(qh, k, v, mask, scale, cap, sinks)
        return o[0].transpose(0, 1)


def _explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(mask(cap * tanh(q k^T * scale / cap))) v with GQA: ``q`` [1, H, Q, D], ``k``
    and ``v`` [1, KVH, L, D], ``mask`` [Q, L] bool (True = attend) -> [1, H, Q, D]; without
    ``cap`` the scores are not capped. ``sinks`` [H]: each head's softmax also runs over its
    sink logit, whose column is then dropped. SDPA has neither (Gemma 2, Gemma Team 2024,
    section 2; gpt-oss's sinks), so the scores are materialized."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if cap is not None:
        scores = scores.div_(cap).tanh_().mul_(cap)
    scores = scores.masked_fill_(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), v)
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v)
