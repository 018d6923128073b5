"""Paged attention backends agree with the reference and with contiguous attention."""

import random

import pytest
import torch
import torch.nn.functional as F

from pagedllm.attention import get_attention_backend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.reference import paged_attention_reference, write_kv


def build_batch(
    query_lens, ctx_lens, block_size, num_blocks, kvh, hd, seed, shared_prefix_blocks=0
):
    """Random paged layout: shuffled physical blocks; optionally the first blocks shared."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    shared = [free.pop() for _ in range(shared_prefix_blocks)]
    tables = []
    for ctx in ctx_lens:
        nb = -(-ctx // block_size)
        table = shared[: min(nb, len(shared))]
        table += [free.pop() for _ in range(nb - len(table))]
        tables.append(table)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    slots = []
    for q, ctx, table in zip(query_lens, ctx_lens, tables):
        for p in range(ctx - q, ctx):
            slots.append(table[p // block_size] * block_size + p % block_size)
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(tables), width, dtype=torch.long)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_tables=bt,
        seq_lens=torch.tensor(ctx_lens),
        query_start_loc=torch.tensor(starts),
        seq_lens_list=list(ctx_lens),
        query_lens_list=list(query_lens),
        query_start_loc_list=starts,
        num_decodes=sum(1 for q in query_lens if q == 1),
        block_size=block_size,
    )
    return meta, tables


@pytest.mark.parametrize("block_size", [1, 3, 16, 64])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_torch_native_matches_reference(block_size, heads, kv_heads):
    torch.manual_seed(block_size * 10 + heads)
    hd = 16
    # decodes first (query length 1), then prefills with and without cached context
    query_lens = [1, 1, 1, 5, 17]
    ctx_lens = [1, 20, 37, 5, 40]
    num_blocks = sum(-(-c // block_size) for c in ctx_lens) + 4
    meta, _ = build_batch(
        query_lens, ctx_lens, block_size, num_blocks, kv_heads, hd, seed=block_size
    )
    shape = (kv_heads, num_blocks, block_size, hd)
    # Fill the whole cache with random "history", as if earlier steps had written it.
    kc, vc = torch.randn(shape), torch.randn(shape)
    t = sum(query_lens)
    q, k, v = torch.randn(t, heads, hd), torch.randn(t, kv_heads, hd), torch.randn(t, kv_heads, hd)
    kc2, vc2 = kc.clone(), vc.clone()
    write_kv(k, v, kc, vc, meta.slot_mapping)
    ref = paged_attention_reference(q, kc, vc, meta, hd**-0.5)
    out = get_attention_backend("torch_native").forward(q, k, v, kc2, vc2, meta, hd**-0.5)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def test_reference_equals_contiguous_causal_attention_with_shared_blocks():
    """The paged reference on shuffled, partly shared blocks equals plain causal SDPA."""
    torch.manual_seed(0)
    bs, heads, kvh, hd = 4, 4, 2, 8
    ctx = [13, 10]  # two prompts sharing their first 2 blocks (8 tokens)
    meta, tables = build_batch(ctx, ctx, bs, 16, kvh, hd, seed=3, shared_prefix_blocks=2)
    prefix_k, prefix_v = torch.randn(8, kvh, hd), torch.randn(8, kvh, hd)
    ks = [torch.cat([prefix_k, torch.randn(c - 8, kvh, hd)]) for c in ctx]
    vs = [torch.cat([prefix_v, torch.randn(c - 8, kvh, hd)]) for c in ctx]
    qs = [torch.randn(c, heads, hd) for c in ctx]
    kc, vc = torch.zeros(kvh, 16, bs, hd), torch.zeros(kvh, 16, bs, hd)
    write_kv(torch.cat(ks), torch.cat(vs), kc, vc, meta.slot_mapping)
    out = paged_attention_reference(torch.cat(qs), kc, vc, meta, hd**-0.5)
    expect = [
        F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.repeat_interleave(2, 1).transpose(0, 1),
            v.repeat_interleave(2, 1).transpose(0, 1),
            is_causal=True,
        ).transpose(0, 1)
        for q, k, v in zip(qs, ks, vs)
    ]
    torch.testing.assert_close(out, torch.cat(expect), atol=1e-5, rtol=1e-4)
    assert tables[0][:2] == tables[1][:2]


def test_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match="attention_backend"):
        get_attention_backend("flash9000")
