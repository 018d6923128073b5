"""bf16 attention on the C++ kernels: AMX tiles against vdpbf16ps, same process.

SmolLM2-135M's attention shape (9 query heads, 3 kv heads, head_dim 64) over a bf16 KV cache in
shuffled blocks; for each case, one call of the decode kernel (1 query token per sequence) or of
the prefill kernel (``q`` query tokens per sequence, after ``ctx`` cached ones: a speculative
verify or a prompt chunk). The two paths (``CpuOps.attention_amx`` on / off, both with bf16 dot
products: the scores and p . V on AMX tiles, or both on vdpbf16ps) alternate call batch by call
batch; prints the median microseconds per call of each and their ratio. By default a call
reads the same blocks as the one before, mostly from cache (the kernels' compute more than their
memory reads); ``--layers 30`` gives each of 30 layers its own cache and times a pass over all
of them, as a step of the bundled model reads them, and prints microseconds per layer. Needs the
avx512 kernel variant on a CPU with amx_bf16 for the AMX side (elsewhere it prints only the
vdpbf16ps figures).

    python benchmarks/attention_score_paths.py [--threads 2] [--block-size 16] [--layers 1]
        [--cases 1x250x1 1x250x9 8x250x1 8x250x9 64x165x1 4x100x100] [--rounds 5]

A case is SEQSxCTXxQ: sequences, context tokens per sequence (the query tokens included), query
tokens per sequence (1: decode).
"""

from __future__ import annotations

import pagedllm  # noqa: F401 (first: it sets OpenMP's barrier spin before torch loads libgomp)

# isort: split
import argparse
import statistics
import time

import torch

from pagedllm.ops.loader import load_cpu_ops
from pagedllm.platform import cpu_flags


def make_call(ops, seqs: int, ctx: int, q: int, block_size: int, kv_caches, gen):
    """A zero-argument function running one kernel call of the case per (key, value) cache pair
    of ``kv_caches`` (the layers of a step)."""
    heads, head_dim = 9, 64  # and 3 kv heads: the caches' first dimension
    num_blocks = kv_caches[0][0].size(1)
    per_seq = -(-ctx // block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:per_seq] for _ in range(seqs)])
    lens = torch.full((seqs,), ctx, dtype=torch.int64)
    query = torch.randn(seqs * q, heads, head_dim, generator=gen)
    out = torch.empty_like(query)
    scale = head_dim**-0.5
    starts = torch.arange(0, (seqs + 1) * q, q, dtype=torch.int64)

    def call() -> None:
        for key_cache, value_cache in kv_caches:
            if q == 1:
                ops.paged_attention_decode(
                    out, query, key_cache, value_cache, tables, lens, seqs, scale
                )
            else:
                ops.paged_attention_prefill(
                    out, query, key_cache, value_cache, tables, lens, starts, 0, seqs, scale
                )

    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--cases", nargs="+", default=["1x250x1", "1x250x9", "8x250x1", "8x250x9", "64x165x1", "4x100x100"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=60, help="calls per case, path and round")
    ap.add_argument("--layers", type=int, default=1,
                    help="caches read in turn per call (30: a step of the bundled model, out of cache)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = load_cpu_ops()
    if ops is None or not ops.attention_bf16_dot(True):
        raise SystemExit("needs the avx512 kernel variant on a CPU with avx512_bf16")
    paths = [True, False] if ops.attention_amx(True) else [False]
    flags = cpu_flags()
    print(f"CPU: {flags.summary()}; threads {args.threads}; block size {args.block_size}; "
          f"{args.layers} layer cache(s), us per layer")
    gen = torch.Generator().manual_seed(0)
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases]
    need = max(s * -(-c // args.block_size) for s, c, _ in cases)
    num_blocks = max(4 * need, 2000 if args.layers == 1 else need)
    kv = [
        tuple(torch.randn(3, num_blocks, args.block_size, 64, generator=gen).bfloat16() for _ in range(2))
        for _ in range(args.layers)
    ]
    calls = {case: make_call(ops, *case, args.block_size, kv, gen) for case in cases}
    times: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for case, call in calls.items():
            for amx in paths:
                ops.attention_amx(amx)
                for _ in range(5):
                    call()
                samples = []
                for _ in range(args.calls):
                    t = time.perf_counter()
                    call()
                    samples.append((time.perf_counter() - t) / args.layers)
                times.setdefault((case, amx), []).append(statistics.median(samples))
    ops.attention_amx(True)
    for case in cases:
        seqs, ctx, q = case
        kind = "decode" if q == 1 else "prefill"
        line = f"{seqs:3d} seqs x {ctx:4d} ctx x {q:3d} q ({kind}):"
        us = {amx: 1e6 * statistics.median(times[(case, amx)]) for amx in paths}
        for amx in paths:
            line += f"  {'AMX' if amx else 'vdpbf16ps'} {us[amx]:8.1f} us"
        if len(paths) == 2:
            line += f"  (AMX {us[False] / us[True]:.2f}x)"
        print(line)


if __name__ == "__main__":
    main()
