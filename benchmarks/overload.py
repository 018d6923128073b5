"""Overload: the sustainable request rate, then 3x that rate against ``--max-waiting-requests``.

1. Unloaded: ``--unloaded-requests`` streamed requests one at a time: TTFT (arrival to first
   chunk) and latency.
2. Sustainable rate: ``--max-num-seqs`` closed-loop clients for ``--phase-seconds``: finished
   requests per second (the engine's saturated throughput on this workload).
3. Overload: Poisson arrivals at ``--overload-factor`` x the sustainable rate for
   ``--phase-seconds``, the server built with ``--max-waiting-requests``: admitted goodput
   (requests that finished, per second) vs the sustainable rate (target >= 90 %), p99 TTFT of the
   admitted requests vs unloaded (target <= 2x), and how fast a refused request gets its 503.
4. Idle: the process's CPU time over ``--idle-seconds`` with nothing to do (target < 5 % of a
   core).

``--admission queue,slots --rounds 3`` runs the phases for each admission policy in turn (a
fresh server each time), alternating, so a noisy machine affects both alike; the medians of
each policy's ratios are printed last. A policy may carry serve flags after ``/``:
``slots`` schedules prefill-first and stops decode steps for arrivals by default, so
``slots/no-prefill-first/no-interrupt-decode-for-prefill`` is ``slots`` with mixed steps. The
server's split of TTFT (mean queue time and prefill time
from its ``/metrics``) is printed beside the client's figures.

All requests: a ``--prompt-tokens`` prompt (the same long prefix + a number), ``--max-tokens``
generated tokens (ignore_eos), streamed. The server is ``pagedllm serve`` in a child process, so
the load generator (this process) never holds the server's GIL.

    .venv/bin/python benchmarks/overload.py                       # bundled SmolLM2, ~2 minutes
    .venv/bin/python benchmarks/overload.py --admission queue,slots --rounds 3 --idle-seconds 0
    # on a small host, keep the load generator off the server's core(s):
    .venv/bin/python benchmarks/overload.py --server-cpus 0 --server-threads 1 --client-cpus 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_lock  # noqa: E402

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "while",
    "paged",
    "attention",
    "keeps",
    "blocks",
]


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs`` by nearest rank; nan when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * len(s) + 0.5)) - 1))]


async def one(c: httpx.AsyncClient, body: dict) -> tuple[int, float, float]:
    """(status, TTFT s or refusal latency s, total s) of one streamed completion."""
    t0 = time.perf_counter()
    ttft = None
    async with c.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            dt = time.perf_counter() - t0
            return r.status_code, dt, dt
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {"):
                ttft = time.perf_counter() - t0
            if line == "data: [DONE]":
                break
    return 200, ttft if ttft is not None else float("nan"), time.perf_counter() - t0


SPLIT_METRICS = (
    "vllm:time_to_first_token_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
)


def server_sums(url: str) -> dict[str, tuple[float, float]]:
    """(sum s, count) of the server's TTFT, queue-time and prefill-time histograms so far."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for name in SPLIT_METRICS:
        vals = [
            float(ln.split()[-1])
            for suffix in ("_sum", "_count")
            for ln in text.splitlines()
            if ln.startswith(name + suffix)
        ]
        out[name] = (vals[0], vals[1])
    return out


def server_means(before: dict, after: dict) -> dict[str, float]:
    """Mean server-side TTFT, queue time and prefill time (s) of the requests finished between
    two :func:`server_sums` snapshots."""
    means = {}
    for name in SPLIT_METRICS:
        n = after[name][1] - before[name][1]
        key = name.removeprefix("vllm:").removesuffix("_seconds")
        means[f"server_{key}_mean_s"] = (
            (after[name][0] - before[name][0]) / n if n else float("nan")
        )
    return means


def make_body(rng: random.Random, args) -> dict:
    words = [WORDS[i % len(WORDS)] for i in range(args.prompt_tokens - 2)]
    return {
        "prompt": " ".join(words) + f" {rng.randint(0, 10**6)}",
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }


async def unloaded(url: str, args, n: int, seed: int = 1) -> list[tuple[int, float, float]]:
    """``n`` requests one at a time (nothing else in flight)."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        return [await one(c, make_body(rng, args)) for _ in range(n)]


async def closed_loop(url: str, args) -> float:
    rng = random.Random(2)
    end = time.perf_counter() + args.phase_seconds
    done = 0

    async def client() -> None:
        nonlocal done
        async with httpx.AsyncClient(base_url=url, timeout=300) as c:
            while time.perf_counter() < end:
                status, _, _ = await one(c, make_body(rng, args))
                done += status == 200

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(args.max_num_seqs)))
    return done / (time.perf_counter() - t0)


async def open_loop(url: str, rate: float, args) -> tuple[list, float]:
    rng = random.Random(3)
    results: list[tuple[int, float, float]] = []
    tasks = []
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as c:

        async def fire() -> None:
            results.append(await one(c, make_body(rng, args)))

        t0 = time.perf_counter()
        t_next = t0
        while t_next < t0 + args.phase_seconds:
            await asyncio.sleep(max(0.0, t_next - time.perf_counter()))
            tasks.append(asyncio.create_task(fire()))
            t_next += rng.expovariate(rate)
        await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


class ServerProcess:
    """``pagedllm serve`` in a child process on a free 127.0.0.1 port (as in production: the load
    generator in this process never shares the server's GIL or event loop); a context manager.

    Raises:
        RuntimeError: from ``__enter__`` when ``/health`` does not answer within ``timeout_s``.
    """

    def __init__(
        self, serve_args: list[str], cpus: set[int] | None = None, timeout_s: float = 900.0
    ) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port)]
        self.cmd += serve_args
        self.cpus = cpus  # the cores the server may run on (None: any)
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        # The log goes to a file: a pipe nobody reads would block the server once full.
        self.log = tempfile.TemporaryFile()
        cpus = self.cpus
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.timeout_s:
            if self.proc.poll() is not None:
                self.log.seek(0)
                err = self.log.read().decode(errors="replace")
                raise RuntimeError(f"the server exited ({self.proc.returncode}): {err[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.proc.kill()
        raise RuntimeError(f"the server did not answer /health within {self.timeout_s} s")

    def cpu_seconds(self) -> float:
        """User + system CPU time of the server process so far (s)."""
        assert self.proc is not None
        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def parse_cpus(text: str | None) -> set[int] | None:
    """``"0,2-3"`` -> {0, 2, 3}; None or "" -> None (any core)."""
    if not text:
        return None
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def run_config(args, variant: str) -> dict:
    """The four phases against a fresh server process built with ``variant``: an admission
    policy, optionally followed by ``/``-separated serve flags (``slots/prefill-first`` adds
    ``--prefill-first``; ``name=value`` adds ``--name value``)."""
    admission, *flags = variant.split("/")
    serve_args = [
        "--max-model-len", "512",
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-waiting-requests", str(args.max_waiting_requests),
        "--admission", admission,
        "--log-stats-interval", "0",
    ]  # fmt: skip
    for flag in flags:
        name, _, value = flag.partition("=")
        serve_args += [f"--{name}", value] if value else [f"--{name}"]
    if args.server_threads:
        serve_args += ["--num-threads", str(args.server_threads)]
    if args.model:
        serve_args += ["--model", args.model]
    res: dict = {"admission": variant}
    with ServerProcess(serve_args, cpus=parse_cpus(args.server_cpus)) as srv:
        asyncio.run(unloaded(srv.url, args, 1, seed=0))  # warm-up
        snap0 = server_sums(srv.url)
        base = asyncio.run(unloaded(srv.url, args, args.unloaded_requests))
        res.update(
            {f"unloaded_{k}": v for k, v in server_means(snap0, server_sums(srv.url)).items()}
        )
        ttft0 = [t for _, t, _ in base]
        res["unloaded_ttft_p50_s"] = pct(ttft0, 0.5)
        res["unloaded_ttft_p99_s"] = pct(ttft0, 0.99)
        sustainable = asyncio.run(closed_loop(srv.url, args))
        res["sustainable_rps"] = sustainable
        rate = args.overload_factor * sustainable
        snap1 = server_sums(srv.url)
        results, wall = asyncio.run(open_loop(srv.url, rate, args))
        split = server_means(snap1, server_sums(srv.url))
        ok = [r for r in results if r[0] == 200]
        refused = [r for r in results if r[0] == 503]
        res.update(
            offered_rps=rate,
            sent=len(results),
            admitted=len(ok),
            refused_503=len(refused),
            other_status=len(results) - len(ok) - len(refused),
            goodput_rps=len(ok) / wall,
            goodput_vs_sustainable=len(ok) / wall / sustainable,
            admitted_ttft_p50_s=pct([t for _, t, _ in ok], 0.5),
            admitted_ttft_p99_s=pct([t for _, t, _ in ok], 0.99),
            refusal_latency_p50_s=pct([t for _, t, _ in refused], 0.5),
            refusal_latency_p99_s=pct([t for _, t, _ in refused], 0.99),
        )
        res.update({f"admitted_{k}": v for k, v in split.items()})
        res["ttft_p99_vs_unloaded"] = res["admitted_ttft_p99_s"] / res["unloaded_ttft_p99_s"]
        if args.idle_seconds > 0:
            time.sleep(1.0)  # let the engine go idle
            c0, t0 = srv.cpu_seconds(), time.perf_counter()
            time.sleep(args.idle_seconds)
            res["idle_cpu_percent_of_a_core"] = (
                100 * (srv.cpu_seconds() - c0) / (time.perf_counter() - t0)
            )
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-waiting-requests", type=int, default=2)
    p.add_argument(
        "--admission",
        default="queue",
        help="comma-separated EngineConfig.admission policies, run in turn each round; a "
        "policy may carry /-separated serve flags (name or name=value), e.g. "
        "slots,slots/no-prefill-first,slots/max-num-batched-tokens=256",
    )
    p.add_argument("--rounds", type=int, default=1, help="times each policy is run, alternating")
    p.add_argument("--overload-factor", type=float, default=3.0)
    p.add_argument("--phase-seconds", type=float, default=30.0)
    p.add_argument(
        "--unloaded-requests",
        type=int,
        default=120,
        help="sequential unloaded requests; p99 by nearest rank is the slowest of up to 100, "
        "so a sample near the admitted count (120-190 in 25 s phases on 2 Zen 3 cores) "
        "compares like with like",
    )
    p.add_argument("--idle-seconds", type=float, default=10.0)
    p.add_argument(
        "--server-cpus",
        default=None,
        help="cores for the server process, e.g. '0' (default: any); see --client-cpus",
    )
    p.add_argument(
        "--client-cpus",
        default=None,
        help="cores for this load generator, e.g. '1', so it never takes the server's cores",
    )
    p.add_argument("--server-threads", type=int, default=None, help="the server's --num-threads")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    policies = args.admission.split(",")
    client_cpus = parse_cpus(args.client_cpus)
    if client_cpus:
        os.sched_setaffinity(0, client_cpus)
    print(
        f"server cores {args.server_cpus or 'any'}, threads {args.server_threads or 'default'}; "
        f"load generator cores {args.client_cpus or 'any'}"
    )

    runs: list[dict] = []
    with bench_lock():
        for rnd in range(args.rounds):
            for admission in policies:
                res = run_config(args, admission)
                res["round"] = rnd
                runs.append(res)
                print(f"-- round {rnd}, admission={admission}")
                for k, v in res.items():
                    print(f"{k:28s} {v:.4g}" if isinstance(v, float) else f"{k:28s} {v}")
    summary = {}
    for admission in policies:
        mine = [r for r in runs if r["admission"] == admission]
        summary[admission] = {
            k: statistics.median(r[k] for r in mine)
            for k in ("goodput_vs_sustainable", "ttft_p99_vs_unloaded", "refusal_latency_p99_s")
        }
        print(f"== admission={admission}: medians over {len(mine)} runs: {summary[admission]}")
    if args.json:
        out = {"args": vars(args) | {"json": None}, "runs": runs, "medians": summary}
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
