"""Pipeline parallelism on this machine: throughput of the bundled SmolLM2-135M (30 layers) at
pp = 1 vs pp = 2 (multi-process executor, one host), and each stage's idle share at pp = 2.

The engine runs one scheduled batch per step and samples before the next, so a step's forward
crosses the stages one after the other: without micro-batches, a stage idles while the other
computes (about half the time each at pp = 2). On 2 shared cores there is no gain to expect; the
point is the measured idle share, the input to any micro-batching work.

Workload: ``--num-prompts`` random prompts of ``--prompt-len`` tokens, ``--output-len`` greedy
tokens each (ignore_eos), all submitted at once; throughput = (prompt + output tokens) / wall s.

    .venv/bin/python benchmarks/pipeline_parallel.py      # ~1-2 min on 2 cores
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


def run(pp: int, args: argparse.Namespace) -> dict:
    """Throughput (tokens/s) and, at pp > 1, each stage's idle share."""
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    llm = LLM(
        pipeline_parallel_size=pp,
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
    args = ap.parse_args()
    for pp in (1, 2):
        print(json.dumps(run(pp, args)), flush=True)


if __name__ == "__main__":
    main()
