"""Attention sinks (GPT-OSS: a learned logit per query head that joins the softmax's denominator
as a key of value zero) on every attention path: the reference against a direct softmax with a
sink column; the C++ decode and prefill kernels (fp32, bf16 with and without the bf16 tiles,
int8 and fp8 caches; partitions merged inside a work item and across split items; sliding
windows) and torch_native against the reference; the prefill kernel's outputs equal to the
decode kernel's bit for bit with sinks; and the Triton kernels (on the GPU, or interpreted on the
CPU through ``test_kernels.run_triton_checks_interpreted``)."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.attention.reference import paged_attention_reference, write_kv
from pagedllm.attention.torch_native import TorchNativeAttention
from tests.attention.test_decode_prefill_identity import DTYPES, _arithmetic, _cache_pair
from tests.attention.test_kernels import TOL, _meta_to, _triton_device, random_case
from tests.attention.test_kv_dtypes import _kv_case


def _sinks(heads: int, seed: int) -> torch.Tensor:
    """Sink logits about as large as the scaled scores, one far above them (the rescale branch
    of the fold) and one far below (almost nothing)."""
    s = 2.0 * torch.randn(heads, generator=torch.Generator().manual_seed(seed))
    s[0] = 30.0
    if heads > 2:
        s[-1] = -30.0
    return s


def test_reference_sink_is_one_more_softmax_column():
    """One decode query of 2 heads over 5 keys: the reference's output is softmax over the
    scores and the sink, the sink's probability dropped, times V."""
    meta, (q, _, _, _, _), (_, kr, vr) = random_case([1], [5], 4, 2, 1, 8, torch.float32, seed=0)
    sinks = torch.tensor([0.7, -1.3])
    out = paged_attention_reference(q, kr, vr, meta, 0.5, sinks=sinks)
    table = meta.block_tables[0].tolist()  # the sequence's keys, in shuffled blocks
    rows = [table[p // 4] * 4 + p % 4 for p in range(5)]
    k, v = kr[0].reshape(-1, 8)[rows], vr[0].reshape(-1, 8)[rows]
    for h in range(2):
        logits = torch.cat([q[0, h] @ k.T * 0.5, sinks[h : h + 1]])
        want = torch.softmax(logits, dim=0)[:5] @ v
        torch.testing.assert_close(out[0, h], want, atol=1e-6, rtol=1e-6)


@pytest.fixture(scope="module")
def cpu_backend(cpu_ops):
    from pagedllm.attention.cpu import CpuPagedAttention

    return CpuPagedAttention(partition_size=64)  # small partitions: both merge paths


# (query_lens, ctx_lens): 1 decode of one kv head splits its partitions over the threads (few
# items); 8 decodes merge theirs inside each item; prefills with and without cached context,
# across partition (64) and tile (128) boundaries.
SINK_LAYOUTS = [
    ([1], [300]),
    ([1] * 8 + [9], [1, 65, 129, 200, 7, 64, 300, 33, 140]),
    ([20, 70], [200, 70]),
]


@pytest.mark.parametrize("window", [None, 5, 70])
@pytest.mark.parametrize("layout", SINK_LAYOUTS)
@pytest.mark.parametrize("dtype,bf16_dot", [(torch.float32, None), (torch.bfloat16, True),
                                            (torch.bfloat16, False)])  # fmt: skip
def test_cpu_kernels_and_torch_native_with_sinks_match_reference(
    cpu_ops, cpu_backend, dtype, bf16_dot, layout, window
):
    from tests.conftest import attention_bf16_dot

    qlens, ctx = layout
    kvh = 1 if len(qlens) == 1 else 2
    heads, hd = kvh * 4, 64
    meta, (q, k, v, kc, vc), (_, kr, vr) = random_case(qlens, ctx, 16, heads, kvh, hd, dtype, 3)
    sinks = _sinks(heads, seed=len(qlens))
    scale = hd**-0.5
    ref = paged_attention_reference(q, kr, vr, meta, scale, window, sinks=sinks)
    plain = paged_attention_reference(q, kr, vr, meta, scale, window)
    assert (ref.float() - plain.float()).abs().max() > 0.1  # the sinks matter here
    with attention_bf16_dot(cpu_ops, bool(bf16_dot)):
        out = cpu_backend.forward(
            q, k, v, kc.clone(), vc.clone(), meta, scale, window, sinks=sinks
        )
    native = TorchNativeAttention().forward(
        q, k, v, kc.clone(), vc.clone(), meta, scale, window, sinks=sinks
    )
    torch.testing.assert_close(out, ref, **TOL[dtype])
    torch.testing.assert_close(native, ref, **TOL[dtype])


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantized_caches_with_sinks_match_reference(cpu_backend, kv_dtype):
    """int8 / fp8 caches: the kernels and torch_native equal the reference on the same
    (dequantized) cache, with sinks."""
    qlens, ctx = [1, 1, 1, 30], [300, 70, 5, 100]
    meta, q, k, v, kq, vq, _ = _kv_case(qlens, ctx, 16, 8, 2, 64, kv_dtype, seed=5)
    sinks = _sinks(8, seed=5)
    kr, vr = kq.clone(), vq.clone()
    write_kv(k, v, kr, vr, meta.slot_mapping)
    for window in (None, 9):
        ref = paged_attention_reference(q, kr, vr, meta, 0.125, window, sinks=sinks)
        out = cpu_backend.forward(
            q, k, v, kq.clone(), vq.clone(), meta, 0.125, window, sinks=sinks
        )
        native = TorchNativeAttention().forward(
            q, k, v, kq.clone(), vq.clone(), meta, 0.125, window, sinks=sinks
        )
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(native, ref, atol=1e-4, rtol=1e-4)


# heads, kv_heads, head_dim, block_size, context, new tokens, window, partition_size
SINK_BITWISE_CASES = [
    (8, 2, 64, 16, 200, 41, 0, 512),  # prefill with context, one partition
    (8, 2, 64, 16, 590, 60, 0, 512),  # keys over two partitions: the merge, then the sink
    (16, 4, 72, 3, 130, 20, 0, 16),  # tiny partitions, a head_dim with a vector tail
    (8, 2, 64, 16, 300, 40, 37, 64),  # sliding window with partitions inside it
    (9, 3, 64, 16, 300, 9, 0, 512),  # a speculative verify's 9 tokens
]


@pytest.mark.parametrize("dtype,bf16_dot,amx", DTYPES)
@pytest.mark.parametrize("heads,kvh,hd,bs,ctx,new,window,psize", SINK_BITWISE_CASES)
def test_prefill_rows_equal_decode_bitwise_with_sinks(
    cpu_ops, dtype, bf16_dot, amx, heads, kvh, hd, bs, ctx, new, window, psize
):
    """With sinks, every prefilled query's output equals its decode output (alone and in a
    decode batch) bit for bit, on every cache dtype and arithmetic."""
    gen = torch.Generator().manual_seed(heads * 100 + ctx + new)
    length = ctx + new
    kc, vc, table = _cache_pair(length, kvh, hd, bs, dtype, gen)
    q_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    q = torch.randn(new, heads, hd, generator=gen).to(q_dtype)
    sinks = _sinks(heads, seed=ctx)
    scale = hd**-0.5
    with _arithmetic(cpu_ops, bf16_dot, amx):
        pre = torch.full_like(q, float("nan"))
        cpu_ops.paged_attention_prefill(
            pre, q, kc, vc, table, torch.tensor([length]), torch.tensor([0, new]), 0, 1, scale,
            psize, window, sinks,
        )  # fmt: skip
        alone = torch.full_like(q, float("nan"))
        for j in range(new):
            cpu_ops.paged_attention_decode(
                alone[j : j + 1], q[j : j + 1], kc, vc, table, torch.tensor([ctx + j + 1]), 1,
                scale, psize, window, sinks,
            )  # fmt: skip
        batch = torch.full_like(q, float("nan"))
        cpu_ops.paged_attention_decode(
            batch, q, kc, vc, table.expand(new, -1).contiguous(),
            torch.arange(ctx + 1, length + 1), new, scale, psize, window, sinks,
        )  # fmt: skip
        plain = torch.empty_like(q)
        cpu_ops.paged_attention_decode(
            plain, q, kc, vc, table.expand(new, -1).contiguous(),
            torch.arange(ctx + 1, length + 1), new, scale, psize, window,
        )  # fmt: skip
    assert torch.equal(pre, alone), (pre.float() - alone.float()).abs().max()
    assert torch.equal(batch, alone)
    assert not torch.equal(plain, alone)  # the sinks did change the output


def test_minus_infinite_sinks_change_no_bit(cpu_ops):
    """Sinks of -inf add e^-inf = 0 to every denominator: the outputs are those without sinks,
    bit for bit, in both kernels."""
    gen = torch.Generator().manual_seed(1)
    kc, vc, table = _cache_pair(300, 2, 64, 16, torch.float32, gen)
    q = torch.randn(30, 8, 64, generator=gen)
    none = torch.full((8,), float("-inf"))
    for sinks in (None, none):
        pre, dec = torch.empty_like(q), torch.empty_like(q[-1:])
        cpu_ops.paged_attention_prefill(
            pre, q, kc, vc, table, torch.tensor([300]), torch.tensor([0, 30]), 0, 1, 0.125, 64,
            0, sinks,
        )  # fmt: skip
        cpu_ops.paged_attention_decode(
            dec, q[-1:], kc, vc, table, torch.tensor([300]), 1, 0.125, 64, 0, sinks
        )
        if sinks is None:
            want_pre, want_dec = pre, dec
    assert torch.equal(pre, want_pre) and torch.equal(dec, want_dec)


def test_sinks_are_checked(cpu_ops):
    """A sinks tensor that is not float32 [num_heads] contiguous is refused."""
    gen = torch.Generator().manual_seed(2)
    kc, vc, table = _cache_pair(20, 2, 32, 16, torch.float32, gen)
    q = torch.randn(1, 4, 32, generator=gen)
    for bad in (torch.zeros(3), torch.zeros(4, dtype=torch.float64), torch.zeros(8)[::2]):
        with pytest.raises(RuntimeError, match="sinks must be"):
            cpu_ops.paged_attention_decode(
                torch.empty_like(q), q, kc, vc, table, torch.tensor([20]), 1, 0.1, 512, 0, bad
            )


def test_triton_sinks_match_reference():
    """The Triton decode and prefill kernels with sinks, with and without a window."""
    device = _triton_device()
    from pagedllm.attention.triton_paged import TritonPagedAttention

    rng = random.Random(0)
    for window in (None, 6):
        meta, (q, k, v, kc, vc), (_, kr, vr) = random_case(
            [1, 1, 13], [40, 5, 30], 4, 4, 2, 16, torch.float32, seed=rng.randint(0, 99)
        )
        sinks = _sinks(4, seed=1)
        ref = paged_attention_reference(q, kr, vr, meta, 0.25, window, sinks=sinks)
        moved = [x.to(device) for x in (q, k, v, kc, vc)]
        out = TritonPagedAttention().forward(
            *moved, _meta_to(meta, device), 0.25, window, sinks=sinks.to(device)
        )
        torch.testing.assert_close(out.cpu(), ref, **TOL[torch.float32])
