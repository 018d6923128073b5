"""Soak with faults: a bounded mixed load against an in-process server, then leak and accounting
checks (issue 24's soak).

``run_soak(app, duration_s)`` serves ``app`` with uvicorn on 127.0.0.1 in a thread and keeps
``concurrency`` clients busy for ``duration_s`` seconds, each request of a random kind:

- ``complete`` / ``stream``: completions, chat streams (shared prompt prefixes: prefix caching);
- ``parallel``: ``n`` = 2-3 samples (``best_of`` sometimes), sampled;
- ``beam``: beam search through the engine's async API (the HTTP API refuses it);
- ``disconnect``: a stream the client closes after its first chunk (the server aborts it);
- ``abandon``: a non-streamed request whose client gives up after 0.2 s (499, aborted);
- ``malformed``: invalid JSON, out-of-range values, an unknown model (4xx expected);
- ``timeout``: a request with a small ``timeout`` field (200 with ``finish_reason: "timeout"``
  or 504).

With a small KV pool the load preempts (swap and recompute). Afterwards the engine must be idle
with every block free in both pools (GPU and host swap), the invariants must hold, the server's
``vllm:request_success_total`` must match the requests the clients saw finish (within the
abandoned ones, which may finish before the server notices), and the process RSS is sampled
every ``rss_interval_s`` (the curve is in the report).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from pagedllm.bench.local_server import LocalServer
from pagedllm.sampling_params import SamplingParams

KINDS = (
    "complete",
    "stream",
    "parallel",
    "beam",
    "disconnect",
    "abandon",
    "malformed",
    "timeout",
)
#: Shared prefixes of the prompts (prefix caching shares their blocks).
PREFIXES = (
    "the quick brown fox jumps over the lazy dog and then",
    "paged attention stores keys and values in blocks so that",
    "a block table maps logical blocks to physical blocks while",
)
#: Outcomes that are a fault of the server (the soak fails on any).
FAULTS = ("server_error", "transport_error", "bad_stream", "unexpected_status")


def rss_bytes() -> int:
    """This process's resident set size (Linux ``/proc/self/status``), bytes; 0 elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class SoakReport:
    """What a soak run saw.

    Attributes:
        duration_s: seconds of load.
        outcomes: (kind, outcome) -> count; outcomes in ``FAULTS`` are server faults.
        finished_ok: engine requests the clients saw finish (200 bodies, complete streams, 504
            timeouts, beams excluded: they bypass HTTP).
        abandoned: requests the clients gave up on (disconnects, abandons).
        metrics_finished: ``vllm:request_success_total`` summed over reasons, after the run.
        leaked_blocks / leaked_swap_blocks: blocks not free once idle (must be 0).
        preemptions: the engine's preemptions during the run.
        rss_curve: (seconds since start, RSS bytes) samples.
    """

    duration_s: float
    outcomes: Counter = field(default_factory=Counter)
    finished_ok: int = 0
    abandoned: int = 0
    metrics_finished: int = 0
    leaked_blocks: int = 0
    leaked_swap_blocks: int = 0
    preemptions: int = 0
    rss_curve: list[tuple[float, int]] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        """Requests sent, all kinds."""
        return sum(self.outcomes.values())

    @property
    def faults(self) -> int:
        """Outcomes that are a fault of the server."""
        return sum(n for (_, o), n in self.outcomes.items() if o in FAULTS)

    def rss_growth(self, warmup_frac: float = 0.25) -> float:
        """RSS growth from the first sample after ``warmup_frac`` of the run to the last, as a
        fraction (0.05 = 5 %); 0 without samples."""
        if len(self.rss_curve) < 2:
            return 0.0
        t_warm = self.rss_curve[-1][0] * warmup_frac
        base = next(r for t, r in self.rss_curve if t >= t_warm)
        return (self.rss_curve[-1][1] - base) / base if base else 0.0

    def summary(self) -> str:
        """A few human-readable lines."""
        by_kind: dict[str, dict[str, int]] = {}
        for (kind, outcome), n in sorted(self.outcomes.items()):
            by_kind.setdefault(kind, {})[outcome] = n
        lines = [
            f"requests: {self.num_requests} in {self.duration_s:.0f} s, faults: {self.faults}, "
            f"preemptions: {self.preemptions}",
            *(f"  {k}: {v}" for k, v in by_kind.items()),
            f"finished (clients): {self.finished_ok}, abandoned: {self.abandoned}, "
            f"vllm:request_success_total: {self.metrics_finished}",
            f"leaked blocks: {self.leaked_blocks} (GPU pool), {self.leaked_swap_blocks} (swap)",
            f"RSS growth after warm-up: {100 * self.rss_growth():.1f} %",
            "RSS curve (s, MiB): "
            + ", ".join(f"({t:.0f}, {r / 2**20:.0f})" for t, r in self.rss_curve),
        ]
        return "\n".join(lines)


class _Client:
    """One simulated client: picks request kinds at random and records their outcomes."""

    def __init__(self, url: str, model: str, ae: Any, rng: random.Random, rep: SoakReport):
        self.url, self.model, self.ae, self.rng, self.rep = url, model, ae, rng, rep

    def prompt(self) -> str:
        return f"{self.rng.choice(PREFIXES)} {self.rng.randint(0, 999)}"

    def record(self, kind: str, outcome: str, finished: int = 0) -> None:
        self.rep.outcomes[(kind, outcome)] += 1
        self.rep.finished_ok += finished

    def status_outcome(self, kind: str, r: httpx.Response, ok: tuple[int, ...] = (200,)) -> None:
        if r.status_code in ok:
            self.record(kind, "ok" if r.status_code == 200 else f"http_{r.status_code}", 1)
        elif r.status_code >= 500:
            self.record(kind, "server_error")
        else:
            self.record(kind, "unexpected_status")

    async def one(self, c: httpx.AsyncClient, kind: str) -> None:
        try:
            await getattr(self, kind)(c)
        except httpx.TransportError:
            self.record(kind, "transport_error")

    async def complete(self, c: httpx.AsyncClient) -> None:
        body = {"model": self.model, "prompt": self.prompt(), "max_tokens": self.rng.randint(1, 24)}
        self.status_outcome("complete", await c.post("/v1/completions", json=body))

    async def stream(self, c: httpx.AsyncClient) -> None:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": self.prompt()}],
            "max_tokens": self.rng.randint(1, 32),
            "stream": True,
        }
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            text = (await r.aread()).decode()
        if r.status_code != 200:
            self.status_outcome("stream", r)
        elif not text.endswith("data: [DONE]\n\n") or '"error"' in text:
            self.record("stream", "bad_stream")
        else:
            self.record("stream", "ok", 1)

    async def parallel(self, c: httpx.AsyncClient) -> None:
        n = self.rng.randint(2, 3)
        body: dict[str, Any] = {"model": self.model, "prompt": self.prompt(), "n": n}
        body.update(max_tokens=self.rng.randint(4, 24), temperature=1.0)
        if self.rng.random() < 0.3:
            body["best_of"] = n + 1
        r = await c.post("/v1/completions", json=body)
        self.status_outcome("parallel", r)
        if r.status_code == 200 and len(r.json()["choices"]) != n:
            self.record("parallel", "bad_stream")

    async def beam(self, c: httpx.AsyncClient) -> None:
        sp = SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0, max_tokens=8)
        rid = f"soak-beam-{self.rng.getrandbits(48)}"

        async def run() -> Any:
            last = None
            async for out in self.ae.generate(rid, self.prompt(), sp):
                last = out
            return last

        fut = asyncio.run_coroutine_threadsafe(run(), self.ae.event_loop)
        try:
            last = await asyncio.wrap_future(fut)
        except Exception:  # noqa: BLE001 - any engine error is a server fault here
            self.record("beam", "server_error")
            return
        ok = last is not None and last.finished and len(last.outputs) == 2
        self.record("beam", "ok" if ok else "bad_stream")

    async def disconnect(self, c: httpx.AsyncClient) -> None:
        body = {"model": self.model, "prompt": self.prompt(), "max_tokens": 64, "stream": True}
        body["ignore_eos"] = True
        async with c.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                self.status_outcome("disconnect", r)
                return
            async for line in r.aiter_lines():
                if line:
                    break  # then leave: closing the response drops the connection
        self.record("disconnect", "client_gone")
        self.rep.abandoned += 1

    async def abandon(self, c: httpx.AsyncClient) -> None:
        body = {"model": self.model, "prompt": self.prompt(), "max_tokens": 64, "ignore_eos": True}
        try:
            r = await c.post("/v1/completions", json=body, timeout=0.2)
        except httpx.TimeoutException:
            self.record("abandon", "client_gone")
            self.rep.abandoned += 1
            return
        self.status_outcome("abandon", r)

    async def malformed(self, c: httpx.AsyncClient) -> None:
        choice = self.rng.randrange(4)
        if choice == 0:
            r = await c.post(
                "/v1/completions",
                content=b"{not json",
                headers={"content-type": "application/json"},
            )
        elif choice == 1:
            r = await c.post("/v1/completions", json={"prompt": "x", "temperature": 9})
        elif choice == 2:
            r = await c.post("/v1/chat/completions", json={"messages": [{"role": "wizard"}]})
        else:
            r = await c.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        if r.status_code in (400, 404) and set(r.json()) == {"error"}:
            self.record("malformed", f"http_{r.status_code}")
        else:
            self.status_outcome("malformed", r, ok=())

    async def timeout(self, c: httpx.AsyncClient) -> None:
        body = {"model": self.model, "prompt": self.prompt(), "max_tokens": 64}
        body.update(ignore_eos=True, timeout=self.rng.choice([0.001, 0.05, 0.2]))
        r = await c.post("/v1/completions", json=body)
        self.status_outcome("timeout", r, ok=(200, 504))


def _metric_sum(text: str, name: str) -> float:
    """Sum of every sample of metric ``name`` in a Prometheus text exposition."""
    pat = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.M)
    return sum(float(v) for v in pat.findall(text))


async def _drive(url: str, model: str, ae: Any, rep: SoakReport, cfg: dict[str, Any]) -> None:
    end = time.monotonic() + cfg["duration_s"]
    t0 = time.monotonic()
    weights = [cfg["weights"].get(k, 1.0) for k in KINDS]

    async def worker(i: int) -> None:
        client = _Client(url, model, ae, random.Random(cfg["seed"] * 1000 + i), rep)
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            while time.monotonic() < end:
                kind = client.rng.choices(KINDS, weights)[0]
                await client.one(c, kind)

    async def sample_rss() -> None:
        while time.monotonic() < end:
            rep.rss_curve.append((time.monotonic() - t0, rss_bytes()))
            await asyncio.sleep(cfg["rss_interval_s"])

    await asyncio.gather(sample_rss(), *(worker(i) for i in range(cfg["concurrency"])))
    rep.rss_curve.append((time.monotonic() - t0, rss_bytes()))


def run_soak(
    app: Any,
    duration_s: float,
    concurrency: int = 6,
    seed: int = 0,
    rss_interval_s: float = 5.0,
    weights: dict[str, float] | None = None,
    idle_timeout_s: float = 60.0,
) -> SoakReport:
    """Serve ``app`` (``create_app`` / ``build_app``) on a free local port and soak it.

    Args:
        app: the server app; its engine is started by the app's lifespan.
        duration_s: seconds of load (requests still running then are awaited).
        concurrency: simultaneous clients.
        seed: seeds the clients' choices.
        rss_interval_s: seconds between RSS samples.
        weights: relative frequency of each kind of ``KINDS`` (default 1 each).
        idle_timeout_s: how long to wait for the engine to drain afterwards.

    Returns:
        the ``SoakReport``; the caller decides what fails (``faults``, leaks, accounting).

    Raises:
        RuntimeError: the server did not start, or the engine did not go idle in time.
    """
    ae = app.state.async_engine
    engine = ae.engine
    rep = SoakReport(duration_s=duration_s)
    before = engine.scheduler.num_preemptions
    cfg = dict(
        duration_s=duration_s,
        concurrency=concurrency,
        seed=seed,
        rss_interval_s=rss_interval_s,
        weights=weights or {},
    )
    with LocalServer(app) as srv:
        url = srv.url
        asyncio.run(_drive(url, app.state.serving.model_name, ae, rep, cfg))
        bm = engine.block_manager
        t_idle = time.monotonic()
        while engine.has_unfinished_requests() or bm.num_free_blocks != bm.num_blocks:
            if time.monotonic() - t_idle > idle_timeout_s:
                raise RuntimeError("the engine did not go idle after the soak")
            time.sleep(0.05)
        # Read on the engine thread, between two steps.
        snap = ae.call_in_engine_thread(_pool_state).result(30)
        rep.leaked_blocks, rep.leaked_swap_blocks = snap
        rep.preemptions = engine.scheduler.num_preemptions - before
        text = httpx.get(url + "/metrics", timeout=30).text
        rep.metrics_finished = int(_metric_sum(text, "vllm:request_success_total"))
    return rep


def _pool_state(engine: Any) -> tuple[int, int]:
    """Engine thread: (blocks not free, swap blocks not free), after checking the invariants."""
    bm = engine.block_manager
    bm.check_invariants()
    swap = getattr(bm, "swap_allocator", None)
    swap_used = 0 if swap is None else bm.num_swap_blocks - swap.num_free
    return bm.num_blocks - bm.num_free_blocks, swap_used


def report_json(rep: SoakReport) -> str:
    """The report as JSON (outcome keys as ``kind/outcome``)."""
    d = {k: v for k, v in rep.__dict__.items() if k != "outcomes"}
    d["outcomes"] = {f"{k}/{o}": n for (k, o), n in rep.outcomes.items()}
    d["faults"] = rep.faults
    d["rss_growth"] = rep.rss_growth()
    return json.dumps(d, indent=1)
