"""End-to-end throughput vs KV block size, ShareGPT and Alpaca (paper figure 18b; issue 6).

For each block size in ``--block-sizes`` (default 1, 2, 4, ..., 256) the bundled model serves the
first ``--num-requests`` requests of each dataset offline (prompt and reference output length as
in paper section 6.1, greedy, ``ignore_eos``) with a KV pool of ``--kv-mib`` MiB, small enough
that memory limits the batch, as on the paper's GPU. Small blocks cost kernel efficiency (more
block-table lookups, shorter inner loops); large blocks waste the unfilled tail of each
sequence's last block, so fewer sequences fit. Prints output tokens/s, the mean number of
sequences per step and the share of allocated KV slots holding tokens, per block size; JSON to
benchmarks/results/block_size.json; ``--plot`` draws docs/figures/block_size.png.

    .venv/bin/python benchmarks/block_size.py --plot
"""

from __future__ import annotations

import pagedllm  # noqa: F401 (first: it sets OpenMP's barrier spin before torch loads libgomp)

# isort: split
import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_lock, dataset_requests, merge_json  # noqa: E402


def run_one(loaded, reqs, block_size: int, kv_mib: int, threads: int) -> dict:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    llm = LLM(
        loaded=loaded,
        block_size=block_size,
        kv_cache_memory=kv_mib * 2**20,
        max_model_len=2048,
        num_threads=threads,
    )
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    st = llm.engine.stats
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    res = {
        "block_size": block_size,
        "output_tok_s": round(n_out / elapsed, 1),
        "elapsed_s": round(elapsed, 1),
        "mean_seqs_per_step": round(st.generation_tokens / max(st.num_steps, 1), 1),
        "slot_utilization": round(st.slot_utilization_sum / max(st.num_steps, 1), 4),
        "preemptions": st.num_preemptions,
        "num_blocks": llm.engine.num_blocks,
    }
    del llm
    gc.collect()
    return res


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result), figsize=(5 * len(result), 3.4), squeeze=False)
    for ax, (name, rows) in zip(axes[0], result.items(), strict=True):
        xs = [str(r["block_size"]) for r in rows]
        ax.bar(xs, [r["output_tok_s"] for r in rows], color="#4c72b0")
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel("output tokens/s")
        ax.set_title(name)
    fig.suptitle("End-to-end throughput vs block size (cf. paper fig. 18b)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block-sizes", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--datasets", default="sharegpt,alpaca")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--kv-mib", type=int, default=192, help="KV pool size in MiB")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plot", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/block_size.json")
    args = ap.parse_args()

    from pagedllm.model.loader import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(None, torch.float32)
    sizes = [int(b) for b in args.block_sizes.split(",")]
    result: dict[str, list[dict]] = {}
    with bench_lock():
        for name in args.datasets.split(","):
            n = args.num_requests * (1 if name == "sharegpt" else 4)
            reqs = dataset_requests(loaded.tokenizer, name, n)
            rows = []
            for bs in sizes:
                rows.append(run_one(loaded, reqs, bs, args.kv_mib, args.threads))
                print(name, json.dumps(rows[-1]), flush=True)
            result[name] = rows
    result_meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "kv_mib": args.kv_mib,
        "num_requests": {"sharegpt": args.num_requests, "alpaca": args.num_requests * 4},
    }
    merge_json(args.out, {**result, "meta": result_meta})
    for name, rows in result.items():
        best = max(rows, key=lambda r: r["output_tok_s"])
        print(f"{name}: best block size {best['block_size']} ({best['output_tok_s']} tok/s)")
    if args.plot:
        plot(result, Path("docs/figures/block_size.png"))


if __name__ == "__main__":
    main()
