"""The C++ prefill kernel gives every query the same output bits as the decode kernel gives that
query alone (csrc/cpu/attention_common.h: one order of arithmetic per query).

This is what makes a token's attention independent of how it is computed: decoded, prefilled
again after recompute preemption, scored with other draft tokens in a speculative verify pass,
or decoded among other sequences. Tolerances would hide the last-bit differences that int8 /
GGUF activation quantization turns into different greedy tokens, so the comparisons here are
``torch.equal``.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from pagedllm.attention.kv_quant import cache_rows_per_block, is_quantized, write_quantized
from tests.conftest import attention_amx, attention_bf16_dot


def _cache_pair(length, kvh, hd, block_size, dtype, gen):
    """K/V caches holding ``length`` random tokens of one sequence in shuffled blocks, and the
    sequence's [1, blocks] block table."""
    nb = -(-length // block_size) + 2
    order = list(range(nb))
    random.Random(int(torch.randint(1 << 30, (1,), generator=gen))).shuffle(order)
    table = torch.tensor([order[: -(-length // block_size)]], dtype=torch.long)
    slots = torch.tensor(
        [table[0, p // block_size].item() * block_size + p % block_size for p in range(length)]
    )
    rows = cache_rows_per_block(block_size, dtype)
    caches = []
    for _ in range(2):
        x = torch.randn(length, kvh, hd, generator=gen)
        if is_quantized(dtype):
            c = torch.zeros(kvh, nb, rows, hd, dtype=dtype)
            write_quantized(x, c, slots)
        else:
            c = torch.zeros(kvh, nb, rows, hd, dtype=dtype)
            c.view(kvh, nb * rows, hd)[:, slots] = x.to(dtype).transpose(0, 1)
        caches.append(c)
    return caches[0], caches[1], table


CASES = [
    # heads, kv_heads, head_dim, block_size, context, new tokens, window, partition_size
    (9, 3, 64, 16, 0, 150, 0, 512),  # SmolLM2's heads, a whole prompt
    (9, 3, 64, 16, 200, 41, 0, 512),  # prefill with context (chunked prefill, recompute)
    (8, 2, 64, 16, 590, 60, 0, 512),  # the queries' keys span two partitions
    (8, 8, 32, 4, 300, 37, 0, 100),  # G = 1; partitions that are not a multiple of the tile
    (16, 4, 72, 3, 130, 20, 0, 16),  # head_dim with a vector tail, tiny partitions
    (10, 2, 20, 16, 60, 23, 0, 0),  # G = 5, head_dim below one vector, no partitions
    (16, 2, 64, 16, 140, 19, 0, 512),  # G = 8: decode's scores also take the batched hsum
    (16, 1, 64, 16, 50, 9, 0, 512),  # G = 16 (the decode kernel's generic path)
    (8, 2, 64, 16, 300, 40, 37, 64),  # sliding window, partitions inside the window
    (8, 2, 64, 32, 100, 150, 129, 512),  # window across a tile boundary
    # Batch-1 speculative verifies (9 query tokens): few items, so the vdpbf16ps kernel splits
    # them by query tokens (on AMX tiles only items fewer than the threads are split, as in the
    # G = 16 case above); one across a partition boundary, one with a sliding window.
    (9, 3, 64, 16, 300, 9, 0, 512),
    (9, 3, 64, 16, 590, 9, 0, 512),
    (8, 2, 64, 16, 300, 9, 37, 64),
]
# Cache dtype, and for bf16 caches whether the kernels take bf16 dot products
# (csrc/cpu/attention_bf16.h, CPUs with avx512_bf16) or fp32 arithmetic, and whether those run
# on AMX tiles (scores and p . V, csrc/cpu/attention_amx.h, CPUs with amx_bf16) or on vdpbf16ps.
DTYPES = [
    pytest.param(torch.float32, None, None, id="float32"),
    pytest.param(torch.bfloat16, True, True, id="bfloat16-dot-amx"),
    pytest.param(torch.bfloat16, True, False, id="bfloat16-dot-vdpbf16ps"),
    pytest.param(torch.bfloat16, False, None, id="bfloat16-fp32"),
    pytest.param(torch.int8, None, None, id="int8"),
    pytest.param(torch.float8_e4m3fn, None, None, id="float8_e4m3fn"),
]


@contextlib.contextmanager
def _arithmetic(cpu_ops, bf16_dot, amx):
    """The kernels' settings of one DTYPES entry (skips where the CPU lacks them)."""
    with attention_bf16_dot(cpu_ops, bool(bf16_dot)), attention_amx(cpu_ops, bool(amx)):
        yield


@pytest.mark.parametrize("dtype,bf16_dot,amx", DTYPES)
@pytest.mark.parametrize("heads,kvh,hd,bs,ctx,new,window,psize", CASES)
def test_prefill_rows_equal_decode_bitwise(
    cpu_ops, dtype, bf16_dot, amx, heads, kvh, hd, bs, ctx, new, window, psize
):
    with _arithmetic(cpu_ops, bf16_dot, amx):
        _check_prefill_rows_equal_decode(
            cpu_ops, dtype, heads, kvh, hd, bs, ctx, new, window, psize
        )


def _check_prefill_rows_equal_decode(cpu_ops, dtype, heads, kvh, hd, bs, ctx, new, window, psize):
    gen = torch.Generator().manual_seed(heads * 1000 + ctx + new + window)
    length = ctx + new
    kc, vc, table = _cache_pair(length, kvh, hd, bs, dtype, gen)
    q_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    q = torch.randn(new, heads, hd, generator=gen).to(q_dtype)
    scale = hd**-0.5
    pre = torch.full_like(q, float("nan"))
    cpu_ops.paged_attention_prefill(
        pre, q, kc, vc, table, torch.tensor([length]), torch.tensor([0, new]), 0, 1, scale,
        psize, window,
    )  # fmt: skip
    # Each query decoded alone, then all of them as one decode batch of `new` sequences.
    alone = torch.full_like(q, float("nan"))
    for j in range(new):
        cpu_ops.paged_attention_decode(
            alone[j : j + 1], q[j : j + 1], kc, vc, table, torch.tensor([ctx + j + 1]), 1, scale,
            psize, window,
        )  # fmt: skip
    batch = torch.full_like(q, float("nan"))
    cpu_ops.paged_attention_decode(
        batch, q, kc, vc, table.expand(new, -1).contiguous(),
        torch.arange(ctx + 1, length + 1), new, scale, psize, window,
    )  # fmt: skip
    assert torch.equal(pre, alone), (pre - alone).abs().max()
    assert torch.equal(batch, alone)


@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_split_into_chunks_and_sequences_is_bitwise_the_same(cpu_ops, threads):
    """A prompt prefilled whole, in chunks (chunked prefill) and beside another sequence gives
    the same bits, whatever the thread count."""
    gen = torch.Generator().manual_seed(7)
    heads, kvh, hd, bs, length = 9, 3, 64, 16, 700
    kc, vc, table = _cache_pair(length, kvh, hd, bs, torch.float32, gen)
    q = torch.randn(length, heads, hd, generator=gen)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole = torch.empty_like(q)
        cpu_ops.paged_attention_prefill(
            whole, q, kc, vc, table, torch.tensor([length]), torch.tensor([0, length]), 0, 1,
            0.125, 512, 0,
        )  # fmt: skip
        chunks = torch.empty_like(q)
        for lo, hi in [(0, 100), (100, 137), (137, 600), (600, 700)]:
            cpu_ops.paged_attention_prefill(
                chunks[lo:hi], q[lo:hi], kc, vc, table, torch.tensor([hi]),
                torch.tensor([0, hi - lo]), 0, 1, 0.125, 512, 0,
            )  # fmt: skip
        pair = torch.empty(length + 5, heads, hd)
        pair_q = torch.cat([q[:5], q])
        cpu_ops.paged_attention_prefill(
            pair, pair_q, kc, vc, torch.cat([table, table]), torch.tensor([5, length]),
            torch.tensor([0, 5, length + 5]), 0, 2, 0.125, 512, 0,
        )  # fmt: skip
    finally:
        torch.set_num_threads(old)
    assert torch.equal(chunks, whole)
    assert torch.equal(pair[5:], whole) and torch.equal(pair[:5], whole[:5])


@pytest.mark.parametrize("dtype,bf16_dot,amx", DTYPES[:4])
def test_a_max_jump_that_underflows_the_rescale_drops_earlier_keys(cpu_ops, dtype, bf16_dot, amx):
    """Keys 0..127 (one tile) score 0 and key 128 (the next tile) scores 200: e^(0 - 200)
    underflows to 0, the softmax is one-hot on key 128, and both kernels return V[128] (they
    once kept the first tile's V sum, skipping the accumulator's rescale at a factor of 0)."""
    hd, bs, length = 32, 16, 129
    nb = -(-length // bs)
    k = torch.zeros(length, hd)
    k[128, 0] = 200.0
    v = torch.randn(length, hd, generator=torch.Generator().manual_seed(0))
    kc = torch.zeros(1, nb, bs, hd, dtype=dtype)
    vc = torch.zeros(1, nb, bs, hd, dtype=dtype)
    kc.view(1, -1, hd)[0, :length] = k.to(dtype)
    vc.view(1, -1, hd)[0, :length] = v.to(dtype)
    q = torch.zeros(1, 1, hd, dtype=dtype)
    q[0, 0, 0] = 1.0
    table = torch.arange(nb).view(1, nb)
    want = vc.view(-1, hd)[128].to(dtype)
    with _arithmetic(cpu_ops, bf16_dot, amx):
        dec, pre = torch.empty_like(q), torch.empty_like(q)
        cpu_ops.paged_attention_decode(dec, q, kc, vc, table, torch.tensor([length]), 1, 1.0)
        cpu_ops.paged_attention_prefill(
            pre, q, kc, vc, table, torch.tensor([length]), torch.tensor([0, 1]), 0, 1, 1.0
        )
    assert torch.equal(dec[0, 0], want) and torch.equal(pre[0, 0], want)
