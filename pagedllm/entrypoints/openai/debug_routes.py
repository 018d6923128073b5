"""The live KV-cache dashboard: read-only snapshot endpoints and the ``/dashboard`` page.

Endpoints (all GET; the ``/debug`` ones need the API key when the server has one):

- ``/debug/kv``: one snapshot (``pagedllm.engine.kv_snapshot``), JSON. Query: ``max_cells``
  (aggregate the block map into at most this many cells when the pool is bigger), ``owners``
  (per-block owner lists, default true), ``tables`` (``all`` default, ``none``, ``auto``: all
  unless there are more than 20,000 entries, or a request id: only that request's tables).
- ``/debug/kv/stream``: the same as server-sent events (``event: snapshot``), ``interval``
  seconds apart (default 0.25, at least 0.1); defaults ``owners=false``, ``tables=auto``. Each
  event also carries ``history_last``, the newest sample of ``/debug/kv/history``.
- ``/debug/kv/history``: one sample a second over the last 10 minutes (KV usage, useful-token
  fraction, running / waiting / swapped requests, tokens/s, preemptions). Sampled on the event loop
  from the counters the engine thread publishes (``AsyncLLMEngine.counters``); it never waits for
  the engine thread.
- ``/debug/engine_stats``: ``EngineStats.summary()`` and the pool's state, from the same counters.
- ``/dashboard`` (+ ``/dashboard/dashboard.js``, ``/dashboard/dashboard.css``): the page. It
  holds no data, so it is served without the API key; it asks for the key and sends it as
  ``Authorization: Bearer`` on its ``/debug`` requests.

Snapshots are taken on the engine thread between two steps (``AsyncLLMEngine.capture_kv``): only
``kv_snapshot.capture`` (list copies) runs there; the JSON is built on a worker thread. Concurrent
viewers share one capture (at most one every 0.1 s).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.kv_snapshot import build_snapshot

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).with_name("static")
STATIC_FILES = {
    "/dashboard": ("dashboard.html", "text/html; charset=utf-8"),
    "/dashboard/": ("dashboard.html", "text/html; charset=utf-8"),
    "/dashboard/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
MIN_CAPTURE_INTERVAL = 0.1
HISTORY_PERIOD = 1.0
HISTORY_LEN = 600
AUTO_TABLES_MAX_ENTRIES = 20_000


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (as given to ``--host``) only listens on the loopback interface."""
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def dashboard_enabled(host: str | None, enable_flag: bool | None) -> bool:
    """``--enable-dashboard`` turns it on anywhere; without it, only on loopback hosts."""
    return bool(enable_flag) or is_loopback(host)


class KVSnapshotSource:
    """Takes raw captures on the engine thread, shared by concurrent viewers."""

    def __init__(self, async_engine: AsyncLLMEngine) -> None:
        self.async_engine = async_engine
        self._raw: dict[str, Any] | None = None
        self._raw_at = -1e9
        self._pending: asyncio.Future | None = None

    async def raw(self, max_age: float = MIN_CAPTURE_INTERVAL) -> dict[str, Any]:
        """A ``kv_snapshot.capture`` at most ``max_age`` seconds old (one capture in flight at a
        time, shared by the callers that wait for it).

        Raises:
            EngineDeadError: the engine thread stopped before taking it.
        """
        now = time.monotonic()
        if self._raw is not None and now - self._raw_at < max_age:
            return self._raw
        if self._pending is None:
            self._pending = asyncio.ensure_future(self.async_engine.capture_kv())
        pending = self._pending
        try:
            raw = await asyncio.shield(pending)
        finally:
            if self._pending is pending and pending.done():
                self._pending = None
        if self._raw is None or raw["monotonic"] >= self._raw["monotonic"]:
            self._raw, self._raw_at = raw, time.monotonic()
        return raw

    async def snapshot(self, **kwargs: Any) -> dict[str, Any]:
        """``kv_snapshot.build_snapshot`` of a recent capture (built on a worker thread);
        ``tables="auto"`` means all unless there are over ``AUTO_TABLES_MAX_ENTRIES`` entries."""
        raw = await self.raw()
        tables = kwargs.get("tables", True)
        if tables == "auto":
            entries = sum(len(t) for t in raw["tables"].values())
            entries += sum(len(t) for t in raw["swapped_tables"].values())
            kwargs["tables"] = entries <= AUTO_TABLES_MAX_ENTRIES
        return await asyncio.to_thread(build_snapshot, raw, **kwargs)


class KVHistory:
    """One sample a second of the engine's published counters (never waits for the engine)."""

    def __init__(self, async_engine: AsyncLLMEngine, maxlen: int = HISTORY_LEN) -> None:
        self.async_engine = async_engine
        self.samples: collections.deque[dict[str, Any]] = collections.deque(maxlen=maxlen)
        self._last: tuple[float, int, int, int, float] | None = None

    def sample(self) -> dict[str, Any] | None:
        """Append (and return) a sample: rates are over the time since the previous call, which
        only sets the baseline (returns None)."""
        c = self.async_engine.counters
        st = c.stats
        now = time.monotonic()
        cur = (now, st.num_steps, st.prompt_tokens, st.generation_tokens, st.slot_utilization_sum)
        last, self._last = self._last, cur
        if last is None:
            return None
        dt = max(1e-6, now - last[0])
        dsteps = cur[1] - last[1]
        s = {
            "time": time.time(),
            "kv_usage": c.kv_usage,
            "blocks_used": c.num_used_blocks,
            "useful_token_fraction": (cur[4] - last[4]) / dsteps if dsteps else None,
            "running": c.num_running,
            "waiting": c.num_waiting,
            "swapped": c.num_swapped,
            "prompt_tokens_per_s": (cur[2] - last[2]) / dt,
            "generation_tokens_per_s": (cur[3] - last[3]) / dt,
            "steps_per_s": dsteps / dt,
            "preemptions": st.num_preemptions,
        }
        self.samples.append(s)
        return s

    async def run(self) -> None:
        """Sample every ``HISTORY_PERIOD`` seconds until cancelled."""
        while True:
            try:
                self.sample()
            except Exception:  # never stop sampling: skip this second
                logger.debug("KV history sample failed", exc_info=True)
            await asyncio.sleep(HISTORY_PERIOD)


class DashboardPages:
    """Outermost ASGI layer serving the static page files (no data, so no API key needed)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.files = {
            path: ((STATIC_DIR / name).read_bytes(), ctype)
            for path, (name, ctype) in STATIC_FILES.items()
        }

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") in ("GET", "HEAD"):
            hit = self.files.get(scope.get("path", ""))
            if hit is not None:
                body, ctype = hit
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [
                            (b"content-type", ctype.encode()),
                            (b"content-length", str(len(body)).encode()),
                            (b"cache-control", b"no-cache"),
                            (b"x-content-type-options", b"nosniff"),
                            (
                                b"content-security-policy",
                                b"default-src 'self'; img-src 'self' data:; style-src 'self'",
                            ),
                        ],
                    }
                )
                await send(
                    {
                        "type": "http.response.body",
                        "body": b"" if scope["method"] == "HEAD" else body,
                    }
                )
                return
        await self.app(scope, receive, send)


def _tables_arg(tables: str) -> bool | str:
    choices: dict[str, bool | str] = {"all": True, "none": False, "auto": "auto"}
    return choices.get(tables, tables)


# Module-level endpoints reading the app's snapshot source and history from ``app.state``
# (set by ``mount_debug_routes``), not closures over them: FastAPI's process-wide cache of
# endpoint callables would keep a closed-over engine alive after its app is gone (routes.py).
router = APIRouter()


def _source(request: Request) -> KVSnapshotSource:
    return request.app.state.kv_source


def _history(request: Request) -> KVHistory:
    return request.app.state.kv_history


@router.get("/debug/kv")
async def debug_kv(
    request: Request,
    max_cells: int | None = Query(None, ge=1),
    owners: bool = True,
    tables: str = "all",
) -> JSONResponse:
    snap = await _source(request).snapshot(
        max_cells=max_cells, include_owners=owners, tables=_tables_arg(tables)
    )
    return JSONResponse(snap)


@router.get("/debug/engine_stats")
async def debug_engine_stats(request: Request) -> dict[str, Any]:
    """``EngineStats.summary()`` (cumulative counters: benchmarks difference two reads) and
    the pool's state, from the counters published after the latest step."""
    c = _source(request).async_engine.counters
    return {
        "kv_manager": c.kv_manager,
        "num_blocks": c.num_blocks,
        "block_size": c.block_size,
        "num_free_blocks": c.num_free_blocks,
        "num_unfinished_requests": c.num_unfinished_requests,
        "stats": c.stats.summary(),
    }


@router.get("/debug/kv/history")
async def debug_kv_history(request: Request) -> dict[str, Any]:
    return {"period_s": HISTORY_PERIOD, "samples": list(_history(request).samples)}


@router.get(
    "/debug/kv/stream",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "SSE events: `snapshot` (JSON), `error` when the engine stops",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        }
    },
)
async def debug_kv_stream(
    request: Request,
    interval: float = Query(0.25, ge=MIN_CAPTURE_INTERVAL, le=60.0),
    max_cells: int | None = Query(None, ge=1),
    owners: bool = False,
    tables: str = "auto",
) -> StreamingResponse:
    source, history = _source(request), _history(request)

    async def events() -> AsyncIterator[str]:
        while True:
            t0 = time.monotonic()
            try:
                snap = await source.snapshot(
                    max_cells=max_cells, include_owners=owners, tables=_tables_arg(tables)
                )
            except Exception as e:  # noqa: BLE001 - the engine stopped: tell and end
                yield f"event: error\ndata: {json.dumps({'error': str(e)})}\n\n"
                return
            snap["history_last"] = history.samples[-1] if history.samples else None
            yield f"event: snapshot\ndata: {json.dumps(snap, separators=(',', ':'))}\n\n"
            if await request.is_disconnected():
                return
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - t0)))

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def mount_debug_routes(app: FastAPI, async_engine: AsyncLLMEngine) -> None:
    """Add the dashboard's endpoints and page to ``app`` (before it starts)."""
    async_engine.enable_kv_stats()  # the history and /debug/engine_stats read it
    app.state.kv_source = KVSnapshotSource(async_engine)
    app.state.kv_history = history = KVHistory(async_engine)
    app.include_router(router)
    app.add_middleware(DashboardPages)  # outermost: the page itself needs no API key

    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        async with inner(a) as state:
            task = asyncio.create_task(history.run())
            try:
                yield state
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    app.router.lifespan_context = lifespan
