"""Pure-PyTorch paged attention: the obviously-right oracle every faster backend is tested against.

KV-cache layout (per layer): ``key_cache`` and ``value_cache`` of shape
[num_kv_heads, num_blocks, block_size, head_dim]. A token at position ``p`` of a sequence lives
in physical block ``block_table[p // block_size]`` at offset ``p % block_size`` (paper section 4.1,
figure 5). Heads come first so that gathering a batch's blocks yields, per head, one contiguous
[tokens, head_dim] matrix per sequence, ready for a batched matmul without another copy.
"""

from __future__ import annotations

import torch

from pagedllm.attention.kv_quant import dequantize_cache, is_quantized, write_quantized
from pagedllm.attention.metadata import AttentionMetadata


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store the new tokens' K and V into their slots (``reshape_and_cache``).

    Args:
        key, value: [T, num_kv_heads, head_dim].
        key_cache, value_cache: [num_kv_heads, num_blocks, block_size, head_dim], same dtype;
            or quantized ([.., block_size + 1, ..] int8 / fp8, see ``kv_quant``).
        slot_mapping: [T] int64 slot ids (block * block_size + offset).
    """
    if is_quantized(key_cache.dtype):
        write_quantized(key, key_cache, slot_mapping)
        write_quantized(value, value_cache, slot_mapping)
        return
    kvh, hd = key.shape[1], key.shape[2]
    key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)  # e.g. fp32 model, bf16 KV
    key_cache.view(kvh, -1, hd).index_copy_(1, slot_mapping, key.transpose(0, 1))
    value_cache.view(kvh, -1, hd).index_copy_(1, slot_mapping, value.transpose(0, 1))


def gather_kv(cache: torch.Tensor, block_table: list[int], context_len: int) -> torch.Tensor:
    """Read a sequence's first ``context_len`` tokens from the paged cache.

    Returns:
        [context_len, num_kv_heads, head_dim].
    """
    bs = cache.shape[2]
    rows = [cache[:, block_table[p // bs], p % bs] for p in range(context_len)]
    return torch.stack(rows)


def paged_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    *,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context.

    One sequence at a time, token by token, with explicit GQA head repetition and a float32
    softmax: slow, simple, and the definition of the right answer.

    Args:
        query: [T, num_heads, head_dim] (new tokens, flat batch as in ``meta``).
        key_cache, value_cache: [num_kv_heads, num_blocks, block_size, head_dim], already holding
            the new tokens' K/V (call ``write_kv`` first).
        meta: batch layout.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        sliding_window: when set, the token at position p sees only keys p - window + 1 .. p
            (Mistral / Gemma local layers; Beltagy et al. 2020, Longformer); None = all.
        logits_soft_cap: when set, scaled scores become ``cap * tanh(scores / cap)`` before the
            softmax (Gemma 2's attention-logit soft-capping).
        sinks: [num_heads] attention-sink logits (gpt-oss), or None: each head's softmax runs
            over its scaled scores plus its sink, whose column is then dropped (it only adds
            ``e^sink`` to the denominator; Xiao et al. 2023, "Efficient Streaming Language
            Models with Attention Sinks").

    Returns:
        [T, num_heads, head_dim], dtype of ``query``.
    """
    key_cache = dequantize_cache(key_cache, torch.float32)
    value_cache = dequantize_cache(value_cache, torch.float32)
    num_heads = query.shape[1]
    num_kv_heads = key_cache.shape[0]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    tables = meta.block_tables.tolist()
    starts = meta.query_start_loc_list
    for i, ctx in enumerate(meta.seq_lens_list):
        q_lo, q_hi = starts[i], starts[i + 1]
        k = gather_kv(key_cache, tables[i], ctx).float().repeat_interleave(group, dim=1)
        v = gather_kv(value_cache, tables[i], ctx).float().repeat_interleave(group, dim=1)
        first_pos = ctx - (q_hi - q_lo)
        for t in range(q_lo, q_hi):
            pos = first_pos + (t - q_lo)
            q = query[t].float()  # [H, D]
            lo = 0 if sliding_window is None else max(0, pos + 1 - sliding_window)
            scores = torch.einsum("hd,lhd->hl", q, k[lo : pos + 1]) * scale
            if logits_soft_cap is not None:
                scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
            if sinks is not None:
                scores = torch.cat([scores, sinks.float()[:, None]], dim=-1)
            probs = torch.softmax(scores, dim=-1)
            if sinks is not None:
                probs = probs[:, :-1]  # the sink's column: it has no value
            out[t] = torch.einsum("hl,lhd->hd", probs, v[lo : pos + 1]).to(query.dtype)
    return out


class ReferenceAttention:
    """``paged_attention_reference`` behind the backend interface (tests run whole models on it)."""

    name = "reference"

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
        write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        return paged_attention_reference(
            query, key_cache, value_cache, meta, scale, sliding_window, logits_soft_cap, sinks=sinks
        )
