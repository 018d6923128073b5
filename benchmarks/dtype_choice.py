"""fp32 vs bf16 on this CPU: the measurement behind dtype="auto" (docs/dtype.md).

Times ``torch.nn.functional.linear`` at the bundled SmolLM2-135M's projection shapes for decode
(M = 1, 8 tokens) and prefill (M = 64, 256 tokens), alternating fp32 and bf16 rounds and quoting
medians, then prints the bf16 / fp32 time ratio and what ``dtype="auto"`` picks here.

Run: ``python benchmarks/dtype_choice.py [--rounds 5]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.platform import auto_dtype_name, cpu_flags

# (out_features, in_features) of SmolLM2-135M: fused QKV, o_proj, gate+up, down, lm_head.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def time_linear_s(m: int, dtype: torch.dtype, reps: int) -> float:
    """Seconds for one pass over all SHAPES with ``m`` input rows in ``dtype`` (mean of reps)."""
    g = torch.Generator().manual_seed(0)
    pairs = [
        (torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype))
        for n, k in SHAPES
    ]
    for a, w in pairs:  # warm-up (oneDNN primitive creation)
        torch.nn.functional.linear(a, w)
    t0 = time.perf_counter()
    for _ in range(reps):
        for a, w in pairs:
            torch.nn.functional.linear(a, w)
    return (time.perf_counter() - t0) / reps


def main() -> None:
    """Print per-M medians for fp32 and bf16 and their ratio."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    flags = cpu_flags()
    print(f"CPU flags: {flags.summary()} | torch threads {torch.get_num_threads()}")
    print(f"dtype=auto picks here: {auto_dtype_name('cpu')}")
    print(f"{'M':>5} {'fp32 ms':>9} {'bf16 ms':>9} {'bf16/fp32':>10}")
    for m in (1, 8, 64, 256):
        reps = 20 if m <= 8 else 3
        times: dict[torch.dtype, list[float]] = {torch.float32: [], torch.bfloat16: []}
        for _ in range(args.rounds):  # alternate so drift hits both alike
            for dtype in times:
                times[dtype].append(time_linear_s(m, dtype, reps))
        f32 = statistics.median(times[torch.float32]) * 1e3
        b16 = statistics.median(times[torch.bfloat16]) * 1e3
        print(f"{m:>5} {f32:>9.2f} {b16:>9.2f} {b16 / f32:>10.2f}")


if __name__ == "__main__":
    main()
