"""The attention kernels' bf16 dot products on bf16 KV caches (csrc/cpu/attention_bf16.h).

Where the CPU has avx512_bf16, the scores are q . k with q rounded to bf16 and p . V takes the
softmax probabilities rounded to bf16, both summed in fp32. ``_emulated`` computes exactly that
in torch (the tiles of 128 keys and the partitions of attention_common.h decide the running
max each probability is rounded against), so the kernels must match it far more closely than
they match the fp32-arithmetic answer. Decode / prefill bit-identity on this path is in
test_decode_prefill_identity.py.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.platform import cpu_flags
from tests.attention.test_decode_prefill_identity import _cache_pair
from tests.conftest import attention_amx, attention_bf16_dot

TILE = 128  # attn::kTile


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float64)


def _emulated(q, kc, vc, table, length, scale, window, psize):
    """[new, H, D] float64: each of the last ``new`` positions' attention with bf16-rounded q
    and probabilities. A probability is e^(s - m) rounded to bf16 with m the running max of
    its partition up to its tile; the partitions merge as flash-decoding does."""
    new, heads, hd = q.shape
    kvh, _, bs, _ = kc.shape
    slots = [table[0, p // bs].item() * bs + p % bs for p in range(length)]
    keys = kc.reshape(kvh, -1, hd)[:, slots].to(torch.float64)  # [KVH, L, D]
    vals = vc.reshape(kvh, -1, hd)[:, slots].to(torch.float64)
    out = torch.empty(new, heads, hd, dtype=torch.float64)
    for j in range(new):
        p = length - new + j
        first = max(0, p - window + 1) if window > 0 else 0
        pos = torch.arange(first, p + 1)
        part = pos // psize if psize > 0 else torch.zeros_like(pos)
        for h in range(heads):
            kh = h // (heads // kvh)
            qb = _bf16(q[j, h].float() * scale)
            s = keys[kh, first : p + 1] @ qb
            acc, total, big = torch.zeros(hd, dtype=torch.float64), 0.0, s.max()
            for pt in part.unique():
                sel = part == pt
                sp, tiles = s[sel], pos[sel] // TILE
                run = torch.empty_like(sp)
                m = -float("inf")
                for t in tiles.unique():  # the running max each tile's probabilities see
                    m = max(m, sp[tiles == t].max().item())
                    run[tiles == t] = m
                prob = _bf16(torch.exp(sp - run)) * torch.exp(run - big)
                acc += prob @ vals[kh, first : p + 1][sel]
                total += torch.exp(sp - big).sum().item()
            out[j, h] = acc / total
    return out


CASES = [
    # heads, kv_heads, head_dim, block_size, context, new tokens, window, partition_size
    (9, 3, 64, 16, 0, 150, 0, 512),  # a whole prompt: odd and even tile starts per query
    (9, 3, 64, 16, 200, 41, 0, 512),  # prefill with context
    (8, 2, 64, 16, 590, 9, 0, 512),  # a batch-1 verify across a partition boundary
    (8, 8, 32, 4, 300, 37, 0, 100),  # head_dim 32, partitions off the tile grid
    (4, 2, 128, 16, 130, 7, 0, 512),  # head_dim 128
    (8, 2, 64, 16, 300, 40, 37, 64),  # sliding window: odd first keys
    (16, 1, 64, 16, 50, 9, 0, 512),  # G = 16 (the decode kernel's generic path)
]


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "vdpbf16ps"])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kvh,hd,bs,ctx,new,window,psize", CASES)
def test_bf16_dot_equals_emulation(
    cpu_ops, amx, q_dtype, heads, kvh, hd, bs, ctx, new, window, psize
):
    """Prefill and decode outputs equal the emulated bf16 arithmetic (up to fp32 sums in another
    order and the kernels' own exp), while the fp32-arithmetic answer is ~1e-3 away; with the
    scores and p . V summed by AMX tiles (csrc/cpu/attention_amx.h) or by vdpbf16ps lanes."""
    gen = torch.Generator().manual_seed(heads * 100 + ctx + new + hd)
    length = ctx + new
    kc, vc, table = _cache_pair(length, kvh, hd, bs, torch.bfloat16, gen)
    q = torch.randn(new, heads, hd, generator=gen).to(q_dtype)
    scale = hd**-0.5
    lens, starts = torch.tensor([length]), torch.tensor([0, new])
    outs = {}
    for on in (True, False):
        with attention_bf16_dot(cpu_ops, on), attention_amx(cpu_ops, amx and on):
            pre = torch.full_like(q, float("nan"))
            cpu_ops.paged_attention_prefill(
                pre, q, kc, vc, table, lens, starts, 0, 1, scale, psize, window
            )
            dec = torch.full_like(q, float("nan"))
            cpu_ops.paged_attention_decode(
                dec, q, kc, vc, table.expand(new, -1).contiguous(),
                torch.arange(ctx + 1, length + 1), new, scale, psize, window,
            )  # fmt: skip
            assert torch.equal(pre, dec)
            outs[on] = pre
    want = _emulated(q, kc, vc, table, length, scale, window, psize)
    got, fp32 = _off_share(outs[True], want), _off_share(outs[False], want)
    # A probability whose exp differs from torch's in the last bit may round to the other bf16
    # neighbour: a few elements are off by more, most match to fp32 rounding.
    assert got < 0.01, (got, fp32)
    assert fp32 > 0.1  # while the fp32-arithmetic answer is off almost everywhere


def _off_share(out: torch.Tensor, want: torch.Tensor) -> float:
    """The share of elements of ``out`` off the emulated answer: by more than 1e-5 for float32
    outputs, not equal to its bf16 rounding for bfloat16 outputs."""
    if out.dtype == torch.bfloat16:
        return (out != want.to(torch.bfloat16)).float().mean().item()
    return ((out.double() - want).abs() > 1e-5).float().mean().item()


@pytest.mark.parametrize("hd", [20, 72])
def test_head_dims_off_the_32_grid_keep_fp32_arithmetic(cpu_ops, hd):
    """head_dim not a multiple of 32: the kernels take the fp32 path whatever the setting."""
    gen = torch.Generator().manual_seed(hd)
    kc, vc, table = _cache_pair(100, 2, hd, 16, torch.bfloat16, gen)
    q = torch.randn(10, 4, hd, generator=gen)
    outs = []
    for on in (False, True):
        with attention_bf16_dot(cpu_ops, on):
            out = torch.empty_like(q)
            cpu_ops.paged_attention_prefill(
                out, q, kc, vc, table, torch.tensor([100]), torch.tensor([0, 10]), 0, 1,
                hd**-0.5, 512, 0,
            )  # fmt: skip
            outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_setting_is_reported_and_restored(cpu_ops):
    """``attention_bf16_dot(None)`` only asks; off is always possible."""
    before = cpu_ops.attention_bf16_dot()
    assert cpu_ops.attention_bf16_dot(None) == before
    assert cpu_ops.attention_bf16_dot(False) is False
    assert cpu_ops.attention_bf16_dot() is False
    cpu_ops.attention_bf16_dot(before)
    assert cpu_ops.attention_bf16_dot() == before


def test_amx_setting_is_reported_and_restored(cpu_ops):
    """``attention_amx(None)`` only asks; off is always possible; on only where the CPU has
    amx_bf16 and amx_tile (the avx512 variant), as the loader's flags say."""
    before = cpu_ops.attention_amx()
    assert cpu_ops.attention_amx(None) == before
    assert cpu_ops.attention_amx(False) is False
    flags = cpu_flags()
    can = cpu_ops.variant == "avx512" and flags.amx_bf16 and flags.has("amx_tile")
    assert cpu_ops.attention_amx(True) is can
    cpu_ops.attention_amx(before)
    assert cpu_ops.attention_amx() == before
