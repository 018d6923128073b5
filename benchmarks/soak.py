"""Soak with faults, by hand (``pagedllm.bench.soak``; tests/entrypoints/test_soak.py runs it
briefly in CI): a mixed load with disconnects, abandoned and malformed requests, deadlines, n > 1,
beam search and preemption against an in-process server, then the leak / accounting checks and
the RSS curve. Exits 1 when a check fails.

    .venv/bin/python benchmarks/soak.py                       # bundled SmolLM2, 5 minutes
    .venv/bin/python benchmarks/soak.py --duration 1800 --num-kv-blocks 32
"""

from __future__ import annotations

import pagedllm  # noqa: F401 (first: it sets OpenMP's barrier spin before torch loads libgomp)

# isort: split
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_lock  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--num-kv-blocks", type=int, default=24, help="a small pool forces preemption")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--rss-interval", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = p.parse_args()

    from pagedllm.bench.soak import report_json, run_soak
    from pagedllm.entrypoints.openai.app import build_app

    app = build_app(
        {
            "model": args.model,
            "max_model_len": args.max_model_len,
            "num_gpu_blocks_override": args.num_kv_blocks,
            "swap_space": "16MiB",
            "max_num_seqs": 8,
        },
        log_stats_interval=0,
    )
    with bench_lock():
        rep = run_soak(
            app, args.duration, args.concurrency, seed=args.seed, rss_interval_s=args.rss_interval
        )
    print(rep.summary())
    if args.json:
        args.json.write_text(report_json(rep))
    ok = (
        rep.faults == 0
        and rep.leaked_blocks == 0
        and rep.leaked_swap_blocks == 0
        and rep.finished_ok <= rep.metrics_finished <= rep.finished_ok + rep.abandoned
        and rep.rss_growth() <= 0.05
    )
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
