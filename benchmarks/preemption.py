"""Preemption by swapping vs by recomputation (paper figure 19).

(a) Figure 19a: the cost of one preemption of a request of ``--req-tokens`` tokens as the block
    size goes 1, 2, 4, ..., 256. Swap = swapping its blocks out to the host swap pool and back in
    (``CacheEngine.swap_out`` + ``swap_in`` on ``engine.executor.worker.cache``, fastest of
    ``--swap-repeats`` calls); recompute = the engine's prefill of the same number of tokens
    (one request, max_tokens=1, prefix caching off; median of ``--prefill-repeats``).
    On this CPU build "device" and "host" pools are both in RAM, so swap is a memory copy, not a
    PCIe transfer as in the paper.
(b) Figure 19b: end-to-end latency under memory pressure. ``--num-requests`` ShareGPT requests
    (prompt = first human turn truncated to ``--max-prompt`` tokens, output = the reply's length
    capped at ``--max-output``, ignore_eos), all queued at once, with a KV pool of about
    ``--pool-fraction`` of the blocks the whole batch needs, so preemption is forced. Runs
    ``preemption_mode`` swap / recompute / auto for n=1 (greedy) and n=2 (parallel sampling).
    Reports total time, mean per-request latency (finished_time - arrival_time), preemptions by
    mode, and bytes swapped (out + in).

Timed parts hold the machine-wide benchmark lock (common.bench_lock). Prints
tables, writes benchmarks/results/preemption.json, docs/figures/fig19a_swap_vs_recompute.png and
docs/figures/fig19b_preemption_latency.png.

    .venv/bin/python benchmarks/preemption.py                   # defaults: ~3-5 min on 2 cores
    .venv/bin/python benchmarks/preemption.py --num-requests 64 --max-output 128
"""

from __future__ import annotations

import pagedllm  # noqa: F401 (first: it sets OpenMP's barrier spin before torch loads libgomp)

# isort: split
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DATA_DIR, bench_lock, merge_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- (a) figure 19a ----------------------------------------------------------------------------
def swap_vs_recompute(loaded, block_size: int, tokens: list[int], args) -> dict:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    n_tok = len(tokens)
    nb = cdiv(n_tok, block_size)
    llm = LLM(
        loaded=loaded,
        block_size=block_size,
        num_gpu_blocks_override=nb + cdiv(8, block_size) + 2,
        max_model_len=n_tok + 8,
        enable_prefix_caching=False,
        swap_space=(nb + 2) * loaded.config.kv_bytes_per_token(4) * block_size,
    )
    engine = llm.engine
    cache = engine.executor.worker.cache
    pairs = [(i, i) for i in range(nb)]

    def swap_once() -> float:
        t0 = time.perf_counter()
        cache.swap_out(pairs)
        cache.swap_in(pairs)
        return time.perf_counter() - t0

    sp = SamplingParams(temperature=0.0, max_tokens=1)

    def prefill_once() -> float:
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": tokens}], sp, use_tqdm=False)
        return time.perf_counter() - t0

    for _ in range(3):
        swap_once()
    if args.prefill_warmup:
        prefill_once()
    swaps = [swap_once() for _ in range(args.swap_repeats)]
    prefills = [prefill_once() for _ in range(args.prefill_repeats)]
    return {
        "block_size": block_size,
        "num_blocks": nb,
        "bytes_moved": 2 * nb * engine.block_bytes,  # out + in
        "swap_ms": 1e3 * min(swaps),
        "swap_ms_median": 1e3 * statistics.median(swaps),
        "recompute_ms": 1e3 * statistics.median(prefills),
        "recompute_ms_min": 1e3 * min(prefills),
    }


# ---- (b) figure 19b ----------------------------------------------------------------------------
def sharegpt_requests(tok, n: int, max_prompt: int, max_output: int) -> list[tuple[list[int], int]]:
    records = json.loads((DATA_DIR / "sharegpt_1024.json").read_text())
    out = []
    for r in records:
        turns = r.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human":
            continue
        ids = tok(turns[0]["value"], add_special_tokens=False).input_ids[:max_prompt]
        olen = len(tok(turns[1]["value"], add_special_tokens=False).input_ids)
        if len(ids) < 4 or olen < 1:
            continue
        out.append((ids, min(olen, max_output)))
        if len(out) == n:
            return out
    raise RuntimeError(f"only {len(out)} usable ShareGPT records")


def pressure_run(loaded, reqs, mode: str, n: int, num_blocks: int, args) -> dict:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    bs = args.block_size
    full = sum(n * cdiv(len(p) + o, bs) for p, o in reqs)
    llm = LLM(
        loaded=loaded,
        block_size=bs,
        num_gpu_blocks_override=num_blocks,
        max_model_len=max(len(p) + o for p, o in reqs) + 8,
        enable_prefix_caching=False,
        preemption_mode=mode,
        # Room to swap out everything, so "swap" never silently falls back to recompute.
        swap_space=(full + 8) * loaded.config.kv_bytes_per_token(4) * bs,
    )
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=2), use_tqdm=False)
    if n == 1:
        params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    else:
        params = [
            SamplingParams(n=n, temperature=1.0, seed=i, max_tokens=o, ignore_eos=True)
            for i, (_, o) in enumerate(reqs)
        ]
    engine = llm.engine
    base_steps = engine.stats.num_steps
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
    total = time.perf_counter() - t0
    lat = [o.metrics.finished_time - o.metrics.arrival_time for o in outs]
    norm = [lt / o for lt, (_, o) in zip(lat, reqs, strict=True)]
    sched = engine.scheduler
    out_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {
        "mode": mode,
        "n": n,
        "num_blocks": num_blocks,
        "blocks_needed_unshared": full,
        "total_s": total,
        "mean_latency_s": statistics.mean(lat),
        "mean_normalized_latency_s_per_tok": statistics.mean(norm),
        "output_tok_s": out_tokens / total,
        "preemptions": engine.scheduler.num_preemptions,
        "preemptions_by_mode": dict(sched.preemptions_by_mode),
        "blocks_swapped_out": sched.num_blocks_swapped_out,
        "blocks_swapped_in": sched.num_blocks_swapped_in,
        "bytes_swapped": (sched.num_blocks_swapped_out + sched.num_blocks_swapped_in)
        * engine.block_bytes,
        "prompt_tokens_computed": engine.stats.prompt_tokens,
        "steps": engine.stats.num_steps - base_steps,
    }


# ---- figures -----------------------------------------------------------------------------------
def plot_19a(rows: list[dict], req_tokens: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    xs = [r["block_size"] for r in rows]
    ax.plot(xs, [r["swap_ms"] for r in rows], "o-", label="swap out + in")
    ax.plot(xs, [r["recompute_ms"] for r in rows], "s-", label="recompute (prefill)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel(f"ms per preemption of {req_tokens} tokens")
    ax.set_title("Swap vs recompute cost (CPU, SmolLM2-135M fp32)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_19b(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted({r["n"] for r in rows})
    modes = ["swap", "recompute", "auto"]
    fig, axes = plt.subplots(1, len(ns), figsize=(4.2 * len(ns), 3.4), squeeze=False)
    for ax, n in zip(axes[0], ns, strict=True):
        sub = {r["mode"]: r for r in rows if r["n"] == n}
        ms = [m for m in modes if m in sub]
        bars = ax.bar(
            ms, [sub[m]["mean_latency_s"] for m in ms], color=["C0", "C1", "C2"][: len(ms)]
        )
        ax.bar_label(
            bars,
            labels=[f"{sub[m]['mean_latency_s']:.1f}s\n{sub[m]['preemptions']} pre." for m in ms],
            fontsize=8,
        )
        ax.set_ylabel("mean end-to-end latency (s)")
        ax.set_title(f"n={n} ({'greedy' if n == 1 else 'parallel sampling'})", fontsize=10)
        ax.set_ylim(0, 1.25 * max(sub[m]["mean_latency_s"] for m in ms))
    fig.suptitle("Latency under memory pressure by preemption mode", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--req-tokens", type=int, default=256, help="(a) tokens of the preempted request"
    )
    ap.add_argument(
        "--block-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256]
    )
    ap.add_argument("--swap-repeats", type=int, default=20)
    ap.add_argument("--prefill-repeats", type=int, default=2)
    ap.add_argument("--prefill-warmup", action="store_true", help="(a) one untimed prefill first")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument(
        "--pool-fraction",
        type=float,
        default=0.25,
        help="(b) KV pool as a share of the blocks the whole batch needs (n=1)",
    )
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 2], help="(b) samples per request")
    ap.add_argument("--modes", nargs="+", default=["swap", "recompute", "auto"])
    ap.add_argument("--block-size", type=int, default=16, help="(b) block size")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-19a", action="store_true")
    ap.add_argument("--skip-19b", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/preemption.json"))
    args = ap.parse_args()

    from pagedllm.model.loader import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(None)
    tok = loaded.tokenizer
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args)}

    if not args.skip_19a:
        records = json.loads((DATA_DIR / "sharegpt_1024.json").read_text())
        text = " ".join(r["conversations"][0]["value"] for r in records[:20])
        tokens = tok(text, add_special_tokens=False).input_ids[: args.req_tokens]
        assert len(tokens) == args.req_tokens
        rows = []
        print(f"\nFigure 19a: one preemption of a {args.req_tokens}-token request", flush=True)
        print(
            f"{'block':>6}{'blocks':>7}{'MiB moved':>10}{'swap ms':>9}{'recomp ms':>10}"
            f"{'recomp/swap':>12}"
        )
        with bench_lock():
            for bs in args.block_sizes:
                r = swap_vs_recompute(loaded, bs, tokens, args)
                rows.append(r)
                print(
                    f"{bs:6d}{r['num_blocks']:7d}{r['bytes_moved'] / 2**20:10.1f}"
                    f"{r['swap_ms']:9.2f}{r['recompute_ms']:10.1f}"
                    f"{r['recompute_ms'] / r['swap_ms']:12.1f}",
                    flush=True,
                )
        result["fig19a"] = {"req_tokens": args.req_tokens, "rows": rows}
        plot_19a(rows, args.req_tokens, ROOT / "docs/figures/fig19a_swap_vs_recompute.png")
        print("wrote docs/figures/fig19a_swap_vs_recompute.png")

    if not args.skip_19b:
        reqs = sharegpt_requests(tok, args.num_requests, args.max_prompt, args.max_output)
        bs = args.block_size
        need = sum(cdiv(len(p) + o, bs) for p, o in reqs)
        biggest = max(ns * cdiv(len(p) + o, bs) for p, o in reqs for ns in args.ns)
        num_blocks = max(int(need * args.pool_fraction), biggest + 2)
        mean_in = statistics.mean(len(p) for p, _ in reqs)
        mean_out = statistics.mean(o for _, o in reqs)
        print(
            f"\nFigure 19b: {len(reqs)} ShareGPT requests, mean {mean_in:.0f} in / {mean_out:.0f} "
            f"out tokens; pool {num_blocks} blocks x {bs} tokens = "
            f"{100 * num_blocks / need:.0f}% of the {need} blocks the batch needs (n=1)",
            flush=True,
        )
        rows = []
        with bench_lock():
            for n in args.ns:
                for mode in args.modes:
                    r = pressure_run(loaded, reqs, mode, n, num_blocks, args)
                    rows.append(r)
                    print(
                        f"  n={n} {mode:<9} total {r['total_s']:6.1f}s  mean latency "
                        f"{r['mean_latency_s']:6.1f}s  preemptions {r['preemptions_by_mode']}",
                        flush=True,
                    )
        print(
            f"\n{'n':>2} {'mode':<10}{'total s':>8}{'mean lat s':>11}{'s/tok':>7}{'tok/s':>7}"
            f"{'#swap':>6}{'#recomp':>8}{'MiB swapped':>12}{'prompt tok':>11}"
        )
        for r in rows:
            print(
                f"{r['n']:>2} {r['mode']:<10}{r['total_s']:8.1f}{r['mean_latency_s']:11.1f}"
                f"{r['mean_normalized_latency_s_per_tok']:7.3f}{r['output_tok_s']:7.1f}"
                f"{r['preemptions_by_mode']['swap']:6d}{r['preemptions_by_mode']['recompute']:8d}"
                f"{r['bytes_swapped'] / 2**20:12.1f}{r['prompt_tokens_computed']:11d}"
            )
        result["fig19b"] = {
            "num_requests": len(reqs),
            "mean_input_tokens": mean_in,
            "mean_output_tokens": mean_out,
            "block_size": bs,
            "num_blocks": num_blocks,
            "blocks_needed_n1": need,
            "rows": rows,
        }
        plot_19b(rows, ROOT / "docs/figures/fig19b_preemption_latency.png")
        print("wrote docs/figures/fig19b_preemption_latency.png")

    merge_json(args.out, result)


if __name__ == "__main__":
    main()
