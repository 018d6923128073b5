"""KV cache dtypes (float32, bfloat16, int8, fp8 e4m3): the C++ write is byte-identical to the
torch write, the kernels equal the reference on the same (dequantized) cache, stay within each
dtype's tolerance of the float32 answer, block moves carry the scales exactly, and the pool holds
2x / ~3.8x the blocks for the same memory."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.attention.kv_quant import (
    block_scales,
    cache_rows_per_block,
    dequantize_cache,
    parse_kv_cache_dtype,
    write_quantized,
)
from pagedllm.attention.reference import paged_attention_reference, write_kv
from tests.attention.test_kernels import LAYOUTS, make_batch, random_layout
from tests.conftest import attention_bf16_dot

QUANT = [torch.int8, torch.float8_e4m3fn]
KV_DTYPES = [torch.bfloat16, *QUANT]
# Largest relative error ||out - out_fp32|| / ||out_fp32|| per KV dtype on unit-normal K/V
# (measured on these cases, AVX2: bf16 0.2 %, int8 <= 1.2 %, fp8 e4m3 <= 4.3 %).
QUALITY_REL = {torch.bfloat16: 0.005, torch.int8: 0.02, torch.float8_e4m3fn: 0.06}
EXACT = dict(atol=1e-4, rtol=1e-4)



def _empty_cache(kvh, nb, bs, hd, dtype):
    return torch.zeros(kvh, nb, cache_rows_per_block(bs, dtype), hd, dtype=dtype)


def _kv_case(query_lens, ctx_lens, bs, heads, kvh, hd, kv_dtype, seed, shared=0):
    """A batch whose cached history was written through ``write_kv`` in two steps (so scales
    grow and blocks are requantized): the metadata, the new q/k/v, the quantized caches without
    the new tokens, and the answer on float32 caches."""
    meta, nb = make_batch(query_lens, ctx_lens, bs, seed, shared_blocks=shared)
    g = torch.Generator().manual_seed(seed)
    # Every slot of every table, in position order: the history, then the new tokens.
    # Every slot of every table once (shared blocks are shared history), in position order.
    tables = meta.block_tables.tolist()
    seen: dict[int, None] = {}
    for t, ctx in enumerate(ctx_lens):
        for p in range(ctx):
            seen.setdefault(tables[t][p // bs] * bs + p % bs)
    slots = torch.tensor(list(seen), dtype=torch.long)
    n = len(slots)
    k_all = torch.randn(n, kvh, hd, generator=g)
    v_all = torch.randn(n, kvh, hd, generator=g)
    k_all[: n // 2] *= 0.25  # later rows raise the block absmax: requantization
    kq, vq = _empty_cache(kvh, nb, bs, hd, kv_dtype), _empty_cache(kvh, nb, bs, hd, kv_dtype)
    kf, vf = torch.zeros(kvh, nb, bs, hd), torch.zeros(kvh, nb, bs, hd)
    new = set(meta.slot_mapping.tolist())
    old = torch.tensor([s not in new for s in slots.tolist()])
    hist_idx = old.nonzero().flatten()
    for part in (hist_idx[: len(hist_idx) // 2], hist_idx[len(hist_idx) // 2 :]):
        write_kv(k_all[part], v_all[part], kq, vq, slots[part])  # the step writes the rest
    write_kv(k_all, v_all, kf, vf, slots)
    pos = {s: i for i, s in enumerate(slots.tolist())}
    idx = torch.tensor([pos[s] for s in meta.slot_mapping.tolist()])
    q = torch.randn(int(sum(query_lens)), heads, hd, generator=g)
    ref32 = paged_attention_reference(q, kf, vf, meta, hd**-0.5)
    return meta, q, k_all[idx], v_all[idx], kq, vq, ref32


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The quality check. Skipped for layouts with shared blocks: they write new tokens at offset
    0 of a block that holds other sequences' history, which the engine never does (offset 0
    means a fresh block, so the write restarts its scale) and the float32 answer cannot model."""
    return ((out - ref).norm() / ref.norm()).item()


def test_parse_kv_cache_dtype():
    assert parse_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert parse_kv_cache_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert parse_kv_cache_dtype("int8", torch.float32) == torch.int8
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        parse_kv_cache_dtype("int4", torch.float32)


def test_config_rejects_unknown_kv_cache_dtype():
    from pagedllm.config import EngineConfig

    assert EngineConfig(kv_cache_dtype="int8").torch_kv_cache_dtype == torch.int8
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp4")


@pytest.mark.parametrize("dtype", QUANT)
def test_running_absmax_requantizes_and_resets(dtype):
    """Scale = block absmax / qmax; a bigger later row requantizes the block; a write at offset
    0 starts a reused block afresh."""
    qmax = 127.0 if dtype == torch.int8 else 448.0
    cache = _empty_cache(1, 2, 4, 8, dtype)
    a = torch.full((1, 1, 8), 0.5)
    write_quantized(a, cache, torch.tensor([4]))  # block 1, offset 0
    assert block_scales(cache)[0, 1].item() == pytest.approx(0.5 / qmax)
    b = torch.full((1, 1, 8), -2.0)
    write_quantized(b, cache, torch.tensor([5]))
    assert block_scales(cache)[0, 1].item() == pytest.approx(2.0 / qmax)
    deq = dequantize_cache(cache, torch.float32)
    torch.testing.assert_close(deq[0, 1, :2], torch.tensor([[0.5] * 8, [-2.0] * 8]), atol=0.02, rtol=0)
    write_quantized(torch.full((1, 1, 8), 0.01), cache, torch.tensor([4]))  # block reused
    assert block_scales(cache)[0, 1].item() == pytest.approx(0.01 / qmax)


@pytest.mark.parametrize("kv_dtype", [*KV_DTYPES, torch.float32])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_cpu_write_is_byte_identical_to_torch(cpu_ops, kv_dtype, act):
    """reshape_and_cache (C++) and write_kv (torch) leave the same bytes, scales included, over
    a prefill (several tokens per block) then decodes (one per block), with strided K/V."""
    kvh, nb, bs, hd = 3, 9, 4, 16
    g = torch.Generator().manual_seed(1)
    kc = _empty_cache(kvh, nb, bs, hd, kv_dtype)
    vc = torch.zeros_like(kc)
    kr, vr = kc.clone(), vc.clone()
    slots_all = torch.randperm(nb * bs, generator=g)
    steps = [slots_all[:13], slots_all[13:16], slots_all[16:17], slots_all[17:30]]
    for step, slots in enumerate(steps):
        kv = (torch.randn(len(slots), 2, kvh, hd, generator=g) * (1 + step)).to(act)
        k, v = kv[:, 0], kv[:, 1]  # strided views, as split from a fused projection
        slots = slots.clone()
        if step == 0:
            slots[5] = -1
        cpu_ops.reshape_and_cache(k, v, kc, vc, slots)
        keep = slots >= 0  # the C++ op skips negative slots; write_kv wants real ones
        write_kv(k[keep], v[keep], kr, vr, slots[keep])
    assert torch.equal(kc.view(torch.uint8), kr.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vr.view(torch.uint8))


CASES = [
    # block_size, heads, kv_heads, head_dim, layout index, shared blocks
    (1, 4, 4, 16, 0, 0),
    (16, 9, 3, 64, 1, 2),
    (16, 8, 2, 64, 3, 1),
    (5, 10, 2, 20, 2, 0),  # G = 5 (generic prefill path), head_dim with a vector tail
    (3, 16, 1, 72, 0, 0),  # G = 16 (generic decode path)
]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("bs,heads,kvh,hd,layout,shared", CASES)
def test_cpu_kernels_on_kv_dtypes(cpu_ops, kv_dtype, bs, heads, kvh, hd, layout, shared):
    """Decode + prefill with context: equal to the reference on the same dequantized cache, and
    within the dtype's tolerance of the float32-cache answer."""
    from pagedllm.attention.cpu import CpuPagedAttention

    qlens, ctx = LAYOUTS[layout]
    meta, q, k, v, kc, vc, ref32 = _kv_case(
        qlens, ctx, bs, heads, kvh, hd, kv_dtype, seed=bs + heads + layout, shared=shared
    )
    kr, vr = kc.clone(), vc.clone()
    # fp32 arithmetic on bf16 caches too (the bf16 dot products: test_bf16_dot.py).
    with attention_bf16_dot(cpu_ops, False):
        out = CpuPagedAttention().forward(q, k, v, kc, vc, meta, hd**-0.5)
    write_kv(k, v, kr, vr, meta.slot_mapping)
    assert torch.equal(kc.view(torch.uint8), kr.view(torch.uint8))
    ref = paged_attention_reference(q, kr, vr, meta, hd**-0.5)
    torch.testing.assert_close(out, ref, **EXACT)
    if not shared:
        assert _rel_err(out, ref32) < QUALITY_REL[kv_dtype]


@pytest.mark.parametrize("kv_dtype", QUANT)
def test_random_shapes_cpu_and_torch_native(cpu_ops, kv_dtype):
    """Random layouts, block sizes and GQA ratios; the torch path (PAGEDLLM_DISABLE_CPU_KERNELS)
    gives the same answer as the C++ kernels."""
    from pagedllm.attention.cpu import CpuPagedAttention
    from pagedllm.attention.torch_native import TorchNativeAttention

    rng = random.Random(7)
    for trial in range(6):
        bs = rng.choice([1, 2, 5, 16, 32])
        kvh, group, hd = rng.choice([1, 2, 3]), rng.choice([1, 3, 4, 8]), rng.choice([16, 32, 64])
        qlens, ctx = random_layout(rng, 5, 30, 200, 100)
        shared = rng.randint(0, 1)
        meta, q, k, v, kc, vc, ref32 = _kv_case(
            qlens, ctx, bs, kvh * group, kvh, hd, kv_dtype, seed=trial, shared=shared
        )
        kn, vn = kc.clone(), vc.clone()
        out = CpuPagedAttention().forward(q, k, v, kc, vc, meta, hd**-0.5)
        nat = TorchNativeAttention().forward(q, k, v, kn, vn, meta, hd**-0.5)
        assert torch.equal(kc.view(torch.uint8), kn.view(torch.uint8))
        torch.testing.assert_close(out, nat, **EXACT)
        if not shared:
            assert _rel_err(out, ref32) < QUALITY_REL[kv_dtype]


@pytest.mark.parametrize("use_cpu_kernels", [True, False])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_copy_and_swap_carry_scales(cpu_ops, kv_dtype, use_cpu_kernels):
    """Copy-on-write and swap out / in move data and scales byte for byte."""
    from pagedllm.worker.cache_engine import CacheEngine
    from tests.conftest import make_tiny_config

    cfg = make_tiny_config(64, 0)
    ce = CacheEngine(cfg, 8, 4, kv_dtype, num_swap_blocks=4, use_cpu_kernels=use_cpu_kernels)
    g = torch.Generator().manual_seed(0)
    kvh, hd = cfg.num_key_value_heads, cfg.head_dim
    for k, v in ce.kv_caches:
        x = torch.randn(32, kvh, hd, generator=g) * 3
        write_kv(x, -x, k, v, torch.arange(32))
    before = [(k.view(torch.uint8).clone(), v.view(torch.uint8).clone()) for k, v in ce.kv_caches]
    ce.copy_blocks([(1, 6), (2, 7)])
    ce.swap_out([(3, 0), (6, 2)])
    for k, _ in ce.kv_caches:  # clobber the device blocks before swapping back in
        k.view(torch.uint8)[:, [3, 6]] = 0
    ce.swap_in([(0, 3), (2, 5)])
    for (k, v), (k0, v0) in zip(ce.kv_caches, before):
        kb, vb = k.view(torch.uint8), v.view(torch.uint8)
        assert torch.equal(kb[:, 7], k0[:, 2]) and torch.equal(vb[:, 7], v0[:, 2])
        assert torch.equal(kb[:, 6], torch.zeros_like(kb[:, 6]))
        assert torch.equal(kb[:, 3], k0[:, 3]) and torch.equal(kb[:, 5], k0[:, 1])
        assert torch.equal(vb[:, 5], v0[:, 1])


def test_block_counts_for_the_same_memory():
    """bf16 doubles the blocks of fp32; int8 / fp8 hold 4 x block_size / (block_size + 1) times
    as many (the scale row): 3.76x at block size 16."""
    from pagedllm.worker.cache_engine import kv_block_bytes, num_blocks_for_memory
    from tests.conftest import make_tiny_config

    cfg = make_tiny_config(64, 0)
    per_row = cfg.kv_bytes_per_token(1)  # bytes of one token row at 1 byte per value
    mem = 1 << 24
    n = {dt: num_blocks_for_memory(cfg, 16, dt, mem) for dt in [torch.float32, *KV_DTYPES]}
    assert n[torch.float32] == mem // (16 * per_row * 4)
    assert n[torch.bfloat16] == 2 * n[torch.float32]
    assert n[torch.int8] == n[torch.float8_e4m3fn] == mem // (17 * per_row)
    assert kv_block_bytes(cfg, 16, torch.int8) == 17 * per_row


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "int8", "fp8_e4m3"])
def test_engine_greedy_agrees_with_fp32_kv(tiny_llm_factory, kv_cache_dtype):
    """End to end on the tiny model: greedy tokens with a lossy KV cache start like the fp32
    cache's (the random model's logit margins are tiny, so later tokens may drift), and the pool
    has more blocks for the same memory. The quality figures on the real model are in
    docs/kv_cache_dtype.md."""
    from pagedllm.sampling_params import SamplingParams

    prompts = [[5, 9, 13, 2, 40, 41, 7], list(range(10, 45))]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ref_llm = tiny_llm_factory(dtype="float32")
    ref = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, sp)]
    llm = tiny_llm_factory(dtype="float32", kv_cache_dtype=kv_cache_dtype)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert [o[:2] for o in out] == [r[:2] for r in ref]
    same = sum(a == b for r, o in zip(ref, out) for a, b in zip(r, o))
    assert same >= 0.6 * sum(len(r) for r in ref)
    assert llm.engine.num_blocks > ref_llm.engine.num_blocks


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_swap_cow_and_prefix_caching_on_quantized_kv(tiny_llm_factory, kv_cache_dtype):
    """A pool too small for the batch (swap preemption), parallel sampling (copy-on-write of the
    shared last block) and prefix caching on a quantized cache: the same tokens as each request
    alone on a big pool with the same KV dtype (swaps and copies move codes and scales exactly)."""
    from pagedllm.sampling_params import SamplingParams

    prompts = [list(range(3, 3 + n)) for n in (21, 30, 17, 26)]
    prompts.append(prompts[0][:20] + [50])  # shares a full block with the first (prefix hit)
    sp = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    common = dict(block_size=8, max_model_len=96, kv_cache_dtype=kv_cache_dtype)
    alone_llm = tiny_llm_factory(**common)
    alone = [alone_llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]
    llm = tiny_llm_factory(
        **common, num_gpu_blocks_override=14, preemption_mode="swap", enable_prefix_caching=True
    )
    batched = llm.generate(prompts, sp, use_tqdm=False)
    for a, b in zip(alone, batched, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    sched = llm.engine.scheduler
    assert sched.preemptions_by_mode["swap"] > 0 and sched.num_blocks_swapped_in > 0
