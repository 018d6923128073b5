"""How fast the decode attention kernel reads the KV cache from memory, per block size.

A decode step's attention reads every cached K and V row of every running sequence once, so on a
CPU it is bound by memory, not arithmetic. ``kernel_attention.py`` times one layer, whose K/V can
sit in the last-level cache; this script gives each of 30 layers (SmolLM2-135M's depth) its own
cache, so like a real step every layer's K/V comes from DRAM, and reports the rate at which the
C++ ``paged_attention_decode`` kernel consumes K/V bytes (GB/s) for each block size, next to a
plain sequential read of 1 GiB (``torch.sum``) as the machine's reference.

In the ``[KVH, num_blocks, block_size, D]`` cache layout one block of one kv head is
``block_size * D * itemsize`` contiguous bytes (4 KiB at block size 16, D 64, fp32), and
shuffled block tables make the kernel jump between such chunks; small chunks read slower than
one stream.

    python benchmarks/kv_read_bandwidth.py [--block-sizes 16 32 64 128] [--threads 2]
        [--dtype bfloat16]

Holds the machine-wide benchmark lock (``common.bench_lock``) while measuring.
"""

from __future__ import annotations

import pagedllm  # noqa: F401 (first: it sets OpenMP's barrier spin before torch loads libgomp)

# isort: split
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_lock  # noqa: E402
from kernel_attention import decode_meta  # noqa: E402

from pagedllm.attention.cpu import load_cpu_ops  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64  # SmolLM2-135M
SHAPES = [(256, 300), (64, 160), (64, 400), (8, 1500)]  # (sequences, context tokens)


def kv_read_gbs(
    ops, block_size: int, batch: int, ctx: int, dtype: torch.dtype = torch.float32, repeats: int = 3
) -> float:
    """GB/s of K/V consumed by ``paged_attention_decode`` over LAYERS separate caches of
    ``dtype`` (float32 or bfloat16; the queries too), fastest of ``repeats`` passes over all
    layers; block tables are shuffled as in ``kernel_attention.decode_meta``."""
    meta, num_blocks = decode_meta(batch, ctx, block_size, seed=batch * 10007 + ctx)
    g = torch.Generator().manual_seed(batch * 10007 + ctx)
    caches = [
        (
            torch.randn(KV_HEADS, num_blocks, block_size, HEAD_DIM, generator=g).to(dtype),
            torch.randn(KV_HEADS, num_blocks, block_size, HEAD_DIM, generator=g).to(dtype),
        )
        for _ in range(LAYERS)
    ]
    tables, seq_lens = meta.block_tables, meta.seq_lens
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(dtype)
    out = torch.empty_like(q)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for kc, vc in caches:
            ops.paged_attention_decode(out, q, kc, vc, tables, seq_lens, batch, 0.125, 512)
        best = min(best, time.perf_counter() - t0)
    kv_bytes = batch * ctx * 2 * KV_HEADS * HEAD_DIM * dtype.itemsize * LAYERS
    return kv_bytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="passes over all block sizes")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = load_cpu_ops()
    if ops is None:
        raise SystemExit("the C++ CPU kernels could not be built")
    with bench_lock():
        big = torch.ones(2**28)  # 1 GiB
        seq = []
        for _ in range(3):
            t0 = time.perf_counter()
            big.sum()
            seq.append(big.numel() * 4 / (time.perf_counter() - t0) / 1e9)
        del big
        print(f"sequential read (torch.sum over 1 GiB): {max(seq):.1f} GB/s")
        rates: dict[tuple[int, int, int], list[float]] = {}
        for _ in range(args.rounds):  # block sizes alternate, so drift hits all of them
            for batch, ctx in SHAPES:
                for bs in args.block_sizes:
                    rate = kv_read_gbs(ops, bs, batch, ctx, getattr(torch, args.dtype))
                    rates.setdefault((batch, ctx, bs), []).append(rate)
    print(
        f"\nDecode attention K/V read rate (GB/s, best of {args.rounds} rounds), {LAYERS} layers, "
        f"H={HEADS} KVH={KV_HEADS} D={HEAD_DIM} {args.dtype}, {args.threads} threads"
    )
    print("| sequences x context | " + " | ".join(f"block {bs}" for bs in args.block_sizes) + " |")
    print("|---|" + "---:|" * len(args.block_sizes))
    for batch, ctx in SHAPES:
        cells = " | ".join(f"{max(rates[(batch, ctx, bs)]):.1f}" for bs in args.block_sizes)
        print(f"| {batch} x {ctx} | {cells} |")


if __name__ == "__main__":
    main()
