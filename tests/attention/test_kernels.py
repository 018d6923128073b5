"""The C++ CPU kernels and the Triton kernels equal the reference.

The CPU extension is compiled once (about a minute and a half on 2 cores) and cached under
build/torch_extensions/; the tests skip if it cannot be built. The Triton kernels run on CUDA when
there is a GPU, else through the Triton interpreter (TRITON_INTERPRET=1) on small shapes.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.attention import get_attention_backend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.reference import paged_attention_reference, write_kv

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def make_batch(query_lens, ctx_lens, block_size, seed, shared_blocks=0, extra_blocks=3):
    """A random paged layout: shuffled physical blocks, the first ``shared_blocks`` logical blocks
    of every sequence mapped to the same physical blocks (as after a fork / prefix hit) where the
    sequence's cached context fills them. A block this step writes is never shared, as
    copy-on-write guarantees in the engine: two sequences writing one slot in the same step
    would race on a GPU, where the write kernel runs all tokens at once."""
    rng = random.Random(seed)
    need = sum(-(-c // block_size) for c in ctx_lens) + extra_blocks
    free = list(range(need))
    rng.shuffle(free)
    shared = [free.pop() for _ in range(shared_blocks)]
    tables = []
    for q, ctx in zip(query_lens, ctx_lens):
        nb = -(-ctx // block_size)
        full_cached = (ctx - q) // block_size  # blocks holding only context, not this step's rows
        t = shared[: min(full_cached, len(shared))]
        t += [free.pop() for _ in range(nb - len(t))]
        tables.append(t)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    slots = [
        t[p // block_size] * block_size + p % block_size
        for q, ctx, t in zip(query_lens, ctx_lens, tables)
        for p in range(ctx - q, ctx)
    ]
    assert len(set(slots)) == len(slots), "two new tokens share a slot"
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(tables), width, dtype=torch.long)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_tables=bt,
        seq_lens=torch.tensor(ctx_lens, dtype=torch.long),
        query_start_loc=torch.tensor(starts, dtype=torch.long),
        seq_lens_list=list(ctx_lens),
        query_lens_list=list(query_lens),
        query_start_loc_list=starts,
        num_decodes=sum(1 for q in query_lens if q == 1),
        block_size=block_size,
    )
    return meta, need


def random_case(query_lens, ctx_lens, block_size, heads, kv_heads, hd, dtype, seed, shared=0):
    """Inputs for one forward: a cache full of random history, new q/k/v, and the reference."""
    meta, num_blocks = make_batch(query_lens, ctx_lens, block_size, seed, shared_blocks=shared)
    g = torch.Generator().manual_seed(seed)
    shape = (kv_heads, num_blocks, block_size, hd)
    kc = torch.randn(shape, generator=g).to(dtype)
    vc = torch.randn(shape, generator=g).to(dtype)
    t = sum(query_lens)
    q = torch.randn(t, heads, hd, generator=g).to(dtype)
    k = torch.randn(t, kv_heads, hd, generator=g).to(dtype)
    v = torch.randn(t, kv_heads, hd, generator=g).to(dtype)
    kr, vr = kc.clone(), vc.clone()
    write_kv(k, v, kr, vr, meta.slot_mapping)
    ref = paged_attention_reference(q, kr, vr, meta, hd**-0.5)
    return meta, (q, k, v, kc, vc), (ref, kr, vr)


def random_layout(
    rng: random.Random, max_decodes: int, max_query: int, max_ctx: int, max_cached: int
) -> tuple[list[int], list[int]]:
    """(query_lens, ctx_lens): up to ``max_decodes`` decodes first, then up to 3 prefills with
    and without cached context (up to ``max_cached`` tokens) before their new tokens."""
    n_dec, n_pre = rng.randint(0, max_decodes), rng.randint(0, 3)
    if n_dec + n_pre == 0:
        n_dec = 1
    qlens = [1] * n_dec + [rng.randint(2, max_query) for _ in range(n_pre)]
    ctx = [rng.randint(1, max_ctx) for _ in range(n_dec)]
    ctx += [q + rng.choice([0, rng.randint(1, max_cached)]) for q in qlens[n_dec:]]
    return qlens, ctx


# (query_lens, ctx_lens): decodes only, prefills only, and mixes (decodes first) with prefills
# that have cached context before their new tokens; lengths not multiples of the block size.
LAYOUTS = [
    ([1, 1, 1], [1, 17, 70]),
    ([1] * 5 + [9, 23], [300, 1, 33, 64, 129, 9, 47]),
    ([1, 6, 31], [1, 6, 90]),  # a decode at position 0, prefill without and with context
    ([1, 1, 40], [257, 600, 65]),
]


# ---------------------------------------------------------------------------------------------
# C++ CPU kernels
# ---------------------------------------------------------------------------------------------



@pytest.fixture(scope="module")
def cpu_backend(cpu_ops):
    from pagedllm.attention.cpu import CpuPagedAttention

    backend = CpuPagedAttention()
    assert backend.is_native
    return backend


CPU_CASES = [
    # block_size, heads, kv_heads, head_dim, layout index, shared blocks
    (1, 4, 4, 16, 0, 0),
    (2, 6, 2, 32, 1, 1),
    (16, 9, 3, 64, 1, 2),
    (16, 8, 2, 64, 3, 1),
    (64, 8, 1, 48, 2, 0),
    (64, 12, 4, 64, 3, 1),
    (256, 9, 3, 64, 1, 1),
    (16, 10, 2, 20, 2, 0),  # G = 5 (generic prefill path) and a head_dim below one vector
    (3, 16, 1, 72, 0, 0),  # G = 16 (generic decode path), head_dim with a vector tail
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs,heads,kvh,hd,layout,shared", CPU_CASES)
def test_cpu_backend_matches_reference(cpu_backend, dtype, bs, heads, kvh, hd, layout, shared):
    qlens, ctx = LAYOUTS[layout]
    meta, (q, k, v, kc, vc), (ref, kr, vr) = random_case(
        qlens, ctx, bs, heads, kvh, hd, dtype, seed=bs * 7 + heads + layout, shared=shared
    )
    out = cpu_backend.forward(q, k, v, kc, vc, meta, hd**-0.5)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)  # reshape_and_cache is exact
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("partition_size", [0, 16, 100])
def test_cpu_decode_partitions_merge(cpu_ops, partition_size):
    """Split long contexts (flash-decoding) give the same answer as one pass."""
    qlens, ctx = [1, 1], [1000, 37]
    meta, (q, k, v, kc, vc), (ref, _, _) = random_case(
        qlens, ctx, 16, 8, 2, 64, torch.float32, seed=5, shared=1
    )
    write_kv(k, v, kc, vc, meta.slot_mapping)
    out = torch.empty_like(q)
    ops = cpu_ops
    ops.paged_attention_decode(
        out, q, kc, vc, meta.block_tables, meta.seq_lens, 2, 64**-0.5, partition_size
    )
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_cpu_random_shapes(cpu_backend):
    """Random batch sizes, lengths, block sizes and GQA ratios (fp32)."""
    rng = random.Random(1234)
    for trial in range(12):
        bs = rng.choice([1, 2, 5, 16, 64, 256])
        kvh = rng.choice([1, 2, 3])
        group = rng.choice([1, 3, 4, 8])
        hd = rng.choice([16, 32, 64])
        qlens, ctx = random_layout(rng, 6, 40, 300, 200)
        meta, (q, k, v, kc, vc), (ref, kr, vr) = random_case(
            qlens,
            ctx,
            bs,
            kvh * group,
            kvh,
            hd,
            torch.float32,
            seed=trial,
            shared=rng.randint(0, 2),
        )
        out = cpu_backend.forward(q, k, v, kc, vc, meta, hd**-0.5)
        assert torch.equal(kc, kr) and torch.equal(vc, vr)
        torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_reshape_and_cache_strided_and_skip(cpu_ops, dtype):
    """Non-contiguous K/V views (as split from a fused projection) land exactly; slot -1 is
    skipped."""
    kvh, nb, bs, hd, t = 3, 7, 4, 8, 9
    kc, vc = torch.zeros(kvh, nb, bs, hd, dtype=dtype), torch.zeros(kvh, nb, bs, hd, dtype=dtype)
    kv = torch.randn(t, 2, kvh, hd).to(dtype)
    k, v = kv[:, 0], kv[:, 1]
    slots = torch.randperm(nb * bs)[:t]
    slots[3] = -1
    ops = cpu_ops
    ops.reshape_and_cache(k, v, kc, vc, slots)
    keep = slots >= 0
    kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
    write_kv(k[keep], v[keep], kr, vr, slots[keep])
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_copy_and_swap_blocks_exact(cpu_ops, dtype):
    from pagedllm.attention import cpu

    layers = [
        (torch.randn(2, 10, 4, 8).to(dtype), torch.randn(2, 10, 4, 8).to(dtype)) for _ in range(3)
    ]
    before = [(k.clone(), v.clone()) for k, v in layers]
    pairs = [(1, 5), (2, 9), (1, 0)]
    cpu.copy_blocks(layers, pairs)
    for (k, v), (k0, v0) in zip(layers, before):
        ek, ev = k0.clone(), v0.clone()
        for s, d in pairs:
            ek[:, d], ev[:, d] = k0[:, s], v0[:, s]
        assert torch.equal(k, ek) and torch.equal(v, ev)

    host = torch.zeros(2, 6, 4, 8, dtype=dtype)
    dev = layers[0][0]
    cpu.swap_blocks(dev, host, [(3, 0), (7, 5)])
    assert torch.equal(host[:, 0], dev[:, 3]) and torch.equal(host[:, 5], dev[:, 7])
    assert not host[:, 1:5].any()
    back = torch.zeros_like(dev)
    cpu.swap_blocks(host, back, [(0, 2), (5, 8)])
    assert torch.equal(back[:, 2], dev[:, 3]) and torch.equal(back[:, 8], dev[:, 7])
    with pytest.raises(RuntimeError, match="out of range"):
        cpu.swap_blocks(dev, host, [(0, 6)])


def test_cpu_backend_registry(cpu_ops):
    assert get_attention_backend("cpu").name == "cpu"
    assert get_attention_backend("auto").name == "cpu"


def _model_logits(tiny_loaded, backend_name):
    """Prefill two prompts (prompt logits), then a mixed step: a decode of one prompt and a
    chunk of a third prompt on top of a cached first chunk. Returns all logits."""
    from pagedllm.core.scheduler_output import ScheduledSequence, SchedulerOutput
    from pagedllm.model.llama import LlamaForCausalLM
    from pagedllm.worker.cache_engine import CacheEngine
    from pagedllm.worker.model_runner import ModelRunner

    cfg = tiny_loaded.config
    model = LlamaForCausalLM(cfg, torch.float32, get_attention_backend(backend_name))
    model.load_weights(tiny_loaded.state_dict)
    bs = 4
    cache = CacheEngine(cfg, 48, bs, torch.float32)
    runner = ModelRunner(model, cache.kv_caches, bs)
    g = torch.Generator().manual_seed(3)
    p = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (11, 6, 19)]
    tables = [[7, 3, 20, 1], [9, 30], [2, 40, 5, 11, 13]]
    s1 = SchedulerOutput()
    s1.scheduled.append(("0", ScheduledSequence(0, p[0], 0, tables[0][:3], True, True)))
    s1.scheduled.append(("1", ScheduledSequence(1, p[1], 0, tables[1][:2], True, True)))
    s1.scheduled.append(("2", ScheduledSequence(2, p[2][:8], 0, tables[2][:2], False, True)))
    o1 = runner.execute(s1)
    s2 = SchedulerOutput()
    s2.scheduled.append(("0", ScheduledSequence(0, [5], 11, tables[0][:3], True)))
    s2.scheduled.append(("1", ScheduledSequence(1, [17], 6, tables[1][:2], True)))
    s2.scheduled.append(("2", ScheduledSequence(2, p[2][8:], 8, tables[2], True, True)))
    o2 = runner.execute(s2)
    return [o1.prompt_logits[i] for i in range(3)] + [o2.logits, o2.prompt_logits[2]]


def test_tiny_model_cpu_equals_reference(tiny_loaded, cpu_ops):
    with torch.no_grad():
        ref = _model_logits(tiny_loaded, "reference")
        out = _model_logits(tiny_loaded, "cpu")
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# Triton kernels (CUDA, or the interpreter on the CPU)
# ---------------------------------------------------------------------------------------------


def _triton_device():
    from pagedllm.attention import triton_paged

    reason = triton_paged.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    return "cuda" if torch.cuda.is_available() else "cpu"


def run_triton_checks_interpreted() -> None:
    """Entry point of the subprocess below: every Triton test body, interpreted on the CPU."""
    for case in TRITON_CASES:
        test_triton_backend_matches_reference(*case)
    test_triton_bf16_matches_reference()
    test_triton_window_matches_reference()
    from tests.attention.test_sinks import test_triton_sinks_match_reference

    test_triton_sinks_match_reference()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the in-process tests run on the GPU")
def test_triton_kernels_interpreted_in_subprocess():
    """On the CPU the Triton interpreter needs TRITON_INTERPRET=1 before triton is first imported,
    which other tests in this process may already have done: run the checks in a fresh process."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    code = (
        "import importlib.util, sys; "
        f"spec = importlib.util.spec_from_file_location('tk', {__file__!r}); "
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
        "m.run_triton_checks_interpreted()"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


TRITON_CASES = [
    # block_size, heads, kv_heads, head_dim, query_lens, ctx_lens, shared
    (1, 4, 4, 16, [1, 1], [3, 9], 0),
    (2, 6, 2, 16, [1, 5], [7, 12], 1),
    (16, 8, 2, 32, [1, 1, 13], [40, 17, 30], 1),
    (64, 9, 3, 16, [1, 7], [70, 7], 0),
    (256, 8, 1, 16, [1, 3], [260, 20], 0),
]


@pytest.mark.parametrize("bs,heads,kvh,hd,qlens,ctx,shared", TRITON_CASES)
def test_triton_backend_matches_reference(bs, heads, kvh, hd, qlens, ctx, shared):
    device = _triton_device()
    from pagedllm.attention.triton_paged import TritonPagedAttention

    meta, (q, k, v, kc, vc), (ref, kr, vr) = random_case(
        qlens, ctx, bs, heads, kvh, hd, torch.float32, seed=bs + heads, shared=shared
    )
    backend = TritonPagedAttention()
    moved = [x.to(device) for x in (q, k, v, kc, vc)]
    meta_d = _meta_to(meta, device)
    out = backend.forward(*moved, meta_d, hd**-0.5)
    assert torch.equal(moved[3].cpu(), kr) and torch.equal(moved[4].cpu(), vr)
    torch.testing.assert_close(out.cpu(), ref, **TOL[torch.float32])


def test_triton_bf16_matches_reference():
    device = _triton_device()
    from pagedllm.attention.triton_paged import TritonPagedAttention

    meta, (q, k, v, kc, vc), (ref, kr, vr) = random_case(
        [1, 1, 6], [20, 5, 9], 4, 4, 2, 16, torch.bfloat16, seed=11, shared=1
    )
    moved = [x.to(device) for x in (q, k, v, kc, vc)]
    out = TritonPagedAttention().forward(*moved, _meta_to(meta, device), 16**-0.5)
    assert torch.equal(moved[3].cpu(), kr) and torch.equal(moved[4].cpu(), vr)
    torch.testing.assert_close(out.cpu(), ref, **TOL[torch.bfloat16])


def test_triton_window_matches_reference():
    """A sliding window shorter than the contexts, decodes and a chunk with cached context."""
    device = _triton_device()
    from pagedllm.attention.triton_paged import TritonPagedAttention

    for window in (1, 6, 21):
        meta, (q, k, v, kc, vc), (_, kr, vr) = random_case(
            [1, 1, 13], [40, 5, 30], 4, 4, 2, 16, torch.float32, seed=window, shared=1
        )
        ref = paged_attention_reference(q, kr, vr, meta, 16**-0.5, window)
        moved = [x.to(device) for x in (q, k, v, kc, vc)]
        out = TritonPagedAttention().forward(*moved, _meta_to(meta, device), 16**-0.5, window)
        torch.testing.assert_close(out.cpu(), ref, **TOL[torch.float32])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_larger_shapes_on_gpu():
    from pagedllm.attention.triton_paged import TritonPagedAttention

    for dtype in (torch.float32, torch.bfloat16):
        meta, (q, k, v, kc, vc), (ref, _, _) = random_case(
            [1] * 6 + [100, 37], [1, 600, 2047, 64, 65, 3, 300, 37], 16, 9, 3, 64, dtype, 2, 2
        )
        moved = [x.cuda() for x in (q, k, v, kc, vc)]
        out = TritonPagedAttention().forward(*moved, _meta_to(meta, "cuda"), 64**-0.5)
        torch.testing.assert_close(out.cpu(), ref, **TOL[dtype])


def _meta_to(meta: AttentionMetadata, device) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping.to(device),
        block_tables=meta.block_tables.to(device),
        seq_lens=meta.seq_lens.to(device),
        query_start_loc=meta.query_start_loc.to(device),
        seq_lens_list=meta.seq_lens_list,
        query_lens_list=meta.query_lens_list,
        query_start_loc_list=meta.query_start_loc_list,
        num_decodes=meta.num_decodes,
        block_size=meta.block_size,
    )
