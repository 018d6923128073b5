"""Cost of KV snapshots on the engine loop (docs/kv-dashboard.md).

1. Time ``capture`` (the part that runs on the engine thread) and ``build_snapshot`` (off the
   engine thread) on a busy pool of 1,000 and of 100,000 blocks.
2. Generation throughput of the same workload with no snapshots, and with a viewer taking one
   every 0.25 s (the dashboard's rate) and every 0.05 s (20x stress): ``capture`` between steps on
   the engine thread, ``build_snapshot`` on another thread, exactly as the server does.

Usage: python benchmarks/kv_snapshot_cost.py [--model PATH] (default: the tiny random model of the
tests, whose steps are short, so the relative cost is an upper bound).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm.config import EngineConfig  # noqa: E402
from pagedllm.engine.kv_snapshot import build_snapshot, capture  # noqa: E402
from pagedllm.engine.llm_engine import LLMEngine  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402


def tiny_loaded():
    from pagedllm.model.loader import LoadedModel
    from tests.conftest import make_random_state_dict, make_tiny_config, make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    cfg = make_tiny_config(len(tok), tok.eos_token_id)
    sd = make_random_state_dict(cfg)
    return LoadedModel(
        config=cfg, state_dict=sd, tokenizer=tok, source=Path("<tiny>"), weight_bytes=0
    )


def make_engine(loaded, num_blocks: int) -> LLMEngine:
    cfg = EngineConfig(
        model=None,
        block_size=16,
        num_gpu_blocks_override=num_blocks,
        max_model_len=512,
        swap_space=0,
        num_threads=1,
        max_num_seqs=64,
    )
    return LLMEngine(cfg, loaded=loaded)


def add_work(eng: LLMEngine, n_req: int = 16, max_tokens: int = 96) -> None:
    prefix = "paged attention stores keys and values in blocks; " * 3
    for i in range(n_req):
        sp = SamplingParams(n=4, seed=i, temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
        eng.add_request(f"r{i}", prefix + f"request {i}", sp)


def run(loaded, num_blocks: int, period: float | None) -> tuple[float, int, list[float]]:
    eng = make_engine(loaded, num_blocks)
    add_work(eng)
    captures: list[float] = []
    builder_busy = threading.Event()
    last = time.monotonic()
    t0 = time.perf_counter()
    gen0 = eng.stats.generation_tokens
    while eng.has_unfinished_requests():
        eng.step()
        if period is not None and time.monotonic() - last >= period:
            last = time.monotonic()
            c0 = time.perf_counter()
            raw = capture(eng)
            captures.append(time.perf_counter() - c0)
            if not builder_busy.is_set():
                builder_busy.set()

                def build(raw=raw) -> None:
                    build_snapshot(raw, max_cells=8192, include_owners=False, tables=False)
                    builder_busy.clear()

                threading.Thread(target=build, daemon=True).start()
    dt = time.perf_counter() - t0
    return (eng.stats.generation_tokens - gen0) / dt, eng.stats.num_steps, captures


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="model path (default: tiny random model)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.model:
        from pagedllm.model.loader import load_model

        loaded = load_model(args.model, None)
    else:
        loaded = tiny_loaded()

    for nb in (1000, 100_000):
        eng = make_engine(loaded, nb)
        add_work(eng)
        for _ in range(30):
            eng.step()
        caps, builds = [], []
        for _ in range(20):
            t = time.perf_counter()
            raw = capture(eng)
            caps.append(time.perf_counter() - t)
            t = time.perf_counter()
            build_snapshot(raw, max_cells=8192, include_owners=False, tables=False)
            builds.append(time.perf_counter() - t)
        print(
            f"pool {nb:>6} blocks, {eng.block_manager.num_used_blocks} used: capture (engine "
            f"thread) median {1e3 * statistics.median(caps):.2f} ms, build (other thread) "
            f"median {1e3 * statistics.median(builds):.2f} ms"
        )

    for nb in (1000, 100_000):
        for label, period in (
            ("no snapshots", None),
            ("every 0.25 s", 0.25),
            ("every 0.05 s", 0.05),
        ):
            rates, steps, caps = [], 0, []
            for _ in range(args.repeats):
                r, steps, c = run(loaded, nb, period)
                rates.append(r)
                caps += c
            cap = f", {len(caps)} captures, max {1e3 * max(caps):.2f} ms" if caps else ""
            print(
                f"pool {nb:>6}: {label:<13} {statistics.median(rates):8.1f} tok/s "
                f"(runs {', '.join(f'{x:.0f}' for x in rates)}; {steps} steps{cap})"
            )


if __name__ == "__main__":
    main()
