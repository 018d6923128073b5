"""Microbenchmark of the native GGUF kernels (``quantization="gguf"``) at batch 1, on the bundled
SmolLM2-135M's real shapes: qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576 (Q4_1)
and the tied LM head 576->49152 (Q8_0).

Each ``GGUFLinear`` is called with one activation row [1, K]:

* **hot**: the same weight again and again (in L2/L3 when it fits): the kernel's compute speed,
  reported as ns per 32-weight block of one row;
* **cold**: cycling through enough copies to exceed ``--cold-mb`` (beyond the L3), as in a decode
  step where every matrix comes from memory: reported as GB/s of weight bytes (quants and
  scales), next to a pure streaming read of the same number of bytes (``torch.sum`` of a float32
  tensor of that size, same thread count);
* the sum of the cold times over one decode step's calls (30 layers x 4 + the LM head);
* ``--rows M ...``: hot time per activation row of [M, K] calls (a batched decode step or a
  prefill chunk, where the weights stay in cache and the kernels' arithmetic sets the speed;
  they unpack each weight block once for up to 4 activation rows).

Random blocks (float16 scales kept small), so the figures do not depend on the file. Runs with
the kernels of the checkout on ``PYTHONPATH``: point it at another checkout to compare.

    PYTHONPATH=. .venv/bin/python benchmarks/gguf_kernels.py --threads 1
"""

from __future__ import annotations

import pagedllm  # noqa: F401 (first: it sets OpenMP's barrier spin before torch loads libgomp)

# isort: split
import argparse
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.model.quant.gguf_native import BLOCK_BYTES, GGUFLinear, repack

if TYPE_CHECKING:
    from pagedllm.ops import CpuOps

# (name, GGUF type, N, K, calls per decode step) of the bundled SmolLM2-135M Q4_1.
SHAPES = [
    ("qkv", "Q4_1", 960, 576, 30),
    ("o", "Q4_1", 576, 576, 30),
    ("gate_up", "Q4_1", 3072, 576, 30),
    ("down", "Q4_1", 576, 1536, 30),
    ("lm_head", "Q8_0", 49152, 576, 1),
]
SCALE_OFFSETS = {"Q4_1": (0, 2), "Q8_0": (0,), "Q4_0": (0,)}


def random_blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, row bytes] uint8 of random quants with small float16 scales."""
    nbytes, per = BLOCK_BYTES[qtype]
    data = rng.integers(0, 256, (n * k // per, nbytes), dtype=np.uint8)
    for o in SCALE_OFFSETS[qtype]:
        data[:, o : o + 2] = (
            rng.uniform(1e-3, 2e-2, len(data)).astype(np.float16).view(np.uint8).reshape(-1, 2)
        )
    return data.reshape(n, -1)


def per_call(fn: Callable[[int], object], calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the seconds per call of ``fn(i)`` for i in range(calls)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def measure(
    qtype: str, n: int, k: int, ops: CpuOps, cold_mb: int, repeats: int, rng: np.random.Generator
) -> tuple[int, float, float, float]:
    """(weight bytes, hot s/call, cold s/call, stream s/read) of one [n, k] matrix."""
    first = GGUFLinear([repack(qtype, random_blocks(qtype, n, k, rng), n)], ops)
    nbytes = first.weight_bytes()
    copies = max(2, -(-cold_mb * 2**20 // nbytes))
    linears = [first] + [
        GGUFLinear([repack(qtype, random_blocks(qtype, n, k, rng), n)], ops)
        for _ in range(copies - 1)
    ]
    x = torch.randn(1, k)
    hot = per_call(lambda _i: first(x), max(20, int(2e8 // nbytes)), repeats)
    cold = per_call(lambda i: linears[i % copies](x), 2 * copies, repeats)
    floats = [torch.ones(nbytes // 4) for _ in range(copies)]
    stream = per_call(lambda i: floats[i % copies].sum(), 2 * copies, repeats)
    return nbytes, hot, cold, stream


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cold-mb", type=int, default=160, help="weight bytes cycled through, MB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", type=int, nargs="*", default=[], help="also time [M, K] calls")
    args = ap.parse_args()

    from pagedllm.ops import load_cpu_ops
    from pagedllm.platform import cpu_flags

    torch.set_num_threads(args.threads)
    ops = load_cpu_ops()
    if ops is None:
        raise SystemExit("the C++ CPU kernels did not load")
    print(f"cpu flags: {cpu_flags().summary()}; threads {args.threads}; {ops.simd_level()}")
    rng = np.random.default_rng(0)
    step_us = 0.0
    print("shape      N x K        MB | hot us  ns/row-block | cold us  GB/s | stream GB/s")
    for name, qtype, n, k, per_step in SHAPES:
        nbytes, hot, cold, stream = measure(qtype, n, k, ops, args.cold_mb, args.repeats, rng)
        step_us += 1e6 * cold * per_step
        print(
            f"{name:8s} {n:5d} x {k:4d} {nbytes / 1e6:6.2f} | {1e6 * hot:7.1f} "
            f"{1e9 * hot / (n * k // 32):6.2f} | {1e6 * cold:7.1f} {nbytes / cold / 1e9:5.1f} | "
            f"{nbytes / stream / 1e9:5.1f}"
        )
    print(f"one decode step's linears (cold, 30 layers x 4 + LM head): {step_us / 1e3:.2f} ms")
    if args.rows:
        print("hot ns per (activation row x row-block), by rows M per call:")
        print("shape   " + "".join(f"{m:>8d}" for m in args.rows))
    for name, qtype, n, k, _ in SHAPES if args.rows else []:
        lin = GGUFLinear([repack(qtype, random_blocks(qtype, n, k, rng), n)], ops)
        cells = []
        for m in args.rows:
            x = torch.randn(m, k)
            calls = max(5, int(2e8 // (lin.weight_bytes() * m)))
            t = per_call(lambda _i, lin=lin, x=x: lin(x), calls, 3)
            cells.append(f"{1e9 * t / (m * n * k // 32):8.3f}")
        print(f"{name:8s}" + "".join(cells))


if __name__ == "__main__":
    main()
