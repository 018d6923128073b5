"""Vectorized PyTorch paged attention: the default CPU backend until the C++ kernel exists.

Decodes (one new token per sequence) are done together: their blocks are gathered through the
block tables into a padded [S, L, kv_heads, D] view, then one masked batched matmul per step.
Prefill sequences are done one at a time with ``scaled_dot_product_attention`` over the gathered
context with a causal mask offset by the cached length (so prefix hits and chunks work).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
    ) -> torch.Tensor:
        """Write K/V of the new tokens, then attend.

        Args:
            query: [T, H, D]; key, value: [T, KVH, D].
            key_cache, value_cache: [num_blocks, block_size, KVH, D].

        Returns:
            [T, H, D].
        """
        write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        out = torch.empty_like(query)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(query[:nd], key_cache, value_cache, meta, scale)
        starts = meta.query_start_loc_list
        for i in range(nd, meta.num_seqs):
            lo, hi = starts[i], starts[i + 1]
            out[lo:hi] = self._prefill(query[lo:hi], key_cache, value_cache, meta, i, scale)
        return out

    @staticmethod
    def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        # [S, nb] block ids -> [S, nb * block_size, KVH, D]
        s, nb = tables.shape
        g = cache[tables]
        return g.view(s, nb * cache.shape[1], cache.shape[2], cache.shape[3])

    def _decode(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        nd = q.shape[0]
        bs = meta.block_size
        max_len = max(meta.seq_lens_list[:nd])
        nb = -(-max_len // bs)
        tables = meta.block_tables[:nd, :nb]
        k = self._gather(key_cache, tables)  # [S, L, KVH, D]
        v = self._gather(value_cache, tables)
        _, length, kvh, d = k.shape
        h = q.shape[1]
        g = h // kvh
        qg = q.view(nd, kvh, g, d)  # [S, KVH, G, D]
        scores = torch.matmul(qg, k.permute(0, 2, 3, 1)) * scale  # [S, KVH, G, L]
        pad = torch.arange(length) >= meta.seq_lens[:nd, None]  # [S, L]
        scores = scores.float().masked_fill_(pad[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        o = torch.matmul(probs, v.permute(0, 2, 1, 3))  # [S, KVH, G, D]
        return o.reshape(nd, h, d)

    def _prefill(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        i: int,
        scale: float,
    ) -> torch.Tensor:
        ctx = meta.seq_lens_list[i]
        ql = q.shape[0]
        nb = -(-ctx // meta.block_size)
        tables = meta.block_tables[i : i + 1, :nb]
        k = self._gather(key_cache, tables)[0, :ctx]  # [L, KVH, D]
        v = self._gather(value_cache, tables)[0, :ctx]
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
        kh = k.transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
        vh = v.transpose(0, 1).unsqueeze(0)
        if ql == ctx:
            o = F.scaled_dot_product_attention(
                qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            # Query t sits at position ctx - ql + t and sees keys 0 .. that position.
            q_pos = torch.arange(ctx - ql, ctx)[:, None]
            mask = torch.arange(ctx)[None, :] <= q_pos
            o = F.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True
            )
        return o[0].transpose(0, 1)
