"""Pipeline parallelism on this machine: throughput of the bundled SmolLM2-135M (30 layers) at
pp = 1 and pp = 2 (multi-process executor, one host), and each stage's idle share at pp = 2 with
1 micro-batch per step (the schedule before micro-batching: a step's forward crosses the stages
one after the other) and with more (``--micro-batches``, default 1,2; 2 = the default, pp).

With ``m`` equal micro-batches a stage idles about ``(pp - 1) / (m + pp - 1)`` of the step
instead of ``(pp - 1) / pp``: 1/3 instead of 1/2 at pp = 2, m = 2. The configurations run one
after the other in the same process, so they meet similar loads from other jobs; compare the
ratios, not the absolute figures, on a shared machine.

Workload: ``--num-prompts`` random prompts of ``--prompt-len`` tokens, ``--output-len`` greedy
tokens each (ignore_eos), all submitted at once; throughput = (prompt + output tokens) / wall s.

    .venv/bin/python benchmarks/pipeline_parallel.py      # ~2-3 min on 2 cores
"""

from __future__ import annotations

import pagedllm  # noqa: F401 (first: it sets OpenMP's barrier spin before torch loads libgomp)

# isort: split
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_lock  # noqa: E402


def run(pp: int, micro_batches: int, args: argparse.Namespace) -> dict:
    """Throughput (tokens/s) and, at pp > 1, each stage's busy seconds and idle share."""
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    llm = LLM(
        pipeline_parallel_size=pp,
        pipeline_micro_batches=micro_batches,
        max_model_len=args.prompt_len + args.output_len + 16,
        num_gpu_blocks_override=1024,
        enable_prefix_caching=False,
        dtype="float32",
    )
    g = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(100, 20000, (args.prompt_len,), generator=g).tolist()}
        for _ in range(args.num_prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    try:
        with bench_lock():
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
        out = {
            "pp": pp,
            "micro_batches": micro_batches if pp > 1 else None,
            "tokens_per_s": args.num_prompts * (args.prompt_len + args.output_len) / wall,
        }
        if pp > 1:
            stats = llm.engine.executor.driver_worker.runner.pipeline_stats
            out["stage_busy_s"] = stats.busy_s
            out["idle_share"] = stats.idle_share()
        return out
    finally:
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument(
        "--micro-batches",
        default="1,2",
        help="comma-separated micro-batches per step to run at pp = 2 (1 = no micro-batching)",
    )
    args = ap.parse_args()
    print(json.dumps(run(1, 1, args)), flush=True)
    for m in (int(x) for x in args.micro_batches.split(",")):
        print(json.dumps(run(2, m, args)), flush=True)


if __name__ == "__main__":
    main()
