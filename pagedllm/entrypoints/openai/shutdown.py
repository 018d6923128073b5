"""Graceful drain on SIGTERM / SIGINT, shared by every front ``pagedllm serve`` runs: one engine,
data-parallel replicas (both one app, ``drain``) and several models (``MultiModelApp.drain``).

The first signal starts the drain: new requests get 503 ``server_draining`` with ``Retry-After``
(``/health`` too), the in-flight ones may finish for the grace period, then the rest are aborted
(streams get an error event and ``[DONE]``, waiting clients 503 ``request_aborted``) and the process
exits 0. A second signal aborts everything at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import signal
import time
from collections.abc import Callable
from typing import Any, Protocol

from pagedllm.engine.async_engine import RequestAbortedError

__all__ = ["AppDrain", "Drainable", "drain", "drain_in_flight", "serve_until_signal"]

logger = logging.getLogger(__name__)

#: Seconds between two looks at the in-flight requests while draining.
DRAIN_POLL_S = 0.05


async def drain_in_flight(
    num_live: Callable[[], int],
    abort_all: Callable[[BaseException], None],
    grace_period: float,
) -> int:
    """Wait up to ``grace_period`` seconds for ``num_live()`` to reach 0, then abort the rest
    with ``abort_all(RequestAbortedError)``. New requests must already be refused (the caller
    sets its draining flag first).

    Returns:
        the number of requests still live (and aborted) when the grace period ran out.
    """
    logger.info(
        "draining: %d request(s) in flight, up to %.1f s to finish", num_live(), grace_period
    )
    end = time.monotonic() + grace_period
    while num_live() and time.monotonic() < end:
        await asyncio.sleep(DRAIN_POLL_S)
    left = num_live()
    if left:
        logger.warning("grace period over: aborting %d request(s)", left)
        abort_all(RequestAbortedError("the server is shutting down"))
    return left


async def drain(app: Any, grace_period: float) -> int:
    """Graceful drain of one app (``create_app``'s; its engine may be data-parallel): refuse new
    requests (``ServerLifecycle.draining``), let the in-flight ones finish for up to
    ``grace_period`` seconds, then abort the rest.

    Returns:
        the number of requests aborted when the grace period ran out.
    """
    app.state.lifecycle.draining = True
    engine = app.state.async_engine
    return await drain_in_flight(lambda: engine.num_live_requests, engine.abort_all, grace_period)


class Drainable(Protocol):
    """What ``serve_until_signal`` needs of a front."""

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop serving requests (None before startup)."""

    async def drain(self, grace_period: float) -> int:
        """Refuse new requests, wait for the in-flight ones, abort the rest; returns how many
        were aborted."""

    def abort_all_threadsafe(self, error: BaseException) -> None:
        """Fail every in-flight request with ``error``, from any thread."""


class AppDrain:
    """``Drainable`` over one ``create_app`` app (its ``app.state.async_engine``)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop | None:
        """The engine's event loop."""
        return self.app.state.async_engine.event_loop  # type: ignore[no-any-return]

    async def drain(self, grace_period: float) -> int:
        """``drain(app, grace_period)``."""
        return await drain(self.app, grace_period)

    def abort_all_threadsafe(self, error: BaseException) -> None:
        """The engine's ``abort_all_threadsafe``."""
        self.app.state.async_engine.abort_all_threadsafe(error)


def serve_until_signal(
    app: Any, target: Drainable, host: str, port: int, log_level: str, grace_period: float
) -> bool:
    """Run ``app`` with uvicorn on ``host:port`` until SIGINT / SIGTERM; the first signal drains
    ``target`` for ``grace_period`` seconds (0: abort at once), a second one aborts everything
    (see the module doc).

    Returns:
        once the server stopped: whether it had started (False: its startup failed, logged).
    """
    import uvicorn

    class _Server(uvicorn.Server):
        draining: concurrent.futures.Future | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:  # no re-raise of the signal: exit 0
            loop = target.event_loop
            if self.draining is None and grace_period > 0 and loop is not None:
                self.draining = asyncio.run_coroutine_threadsafe(self._drain(), loop)
                return
            target.abort_all_threadsafe(RequestAbortedError("the server is shutting down"))
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                self.should_exit = True

        async def _drain(self) -> None:
            await target.drain(grace_period)
            self.should_exit = True

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=5,
    )
    server = _Server(config)
    server.run()
    return bool(server.started)
