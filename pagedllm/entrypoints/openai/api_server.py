"""``pagedllm serve``'s process: build the app (``app.build_app``) and run it with uvicorn until
SIGINT / SIGTERM, then drain (``drain``) and exit.

The server itself is split by responsibility: ``app.py`` (app factory), ``routes.py``,
``serving_completion.py`` / ``serving_chat.py`` / ``serving_common.py`` (the generation
endpoints), ``middleware.py``, ``errors.py``, ``logprobs.py``, ``metrics.py``, ``protocol.py`` and
``debug_routes.py`` (the KV-cache dashboard). ``build_app`` is re-exported here for the code
that imports it from this module (``tests/bench``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import signal
import time
from typing import Any

from pagedllm.engine.async_engine import AsyncLLMEngine, RequestAbortedError
from pagedllm.entrypoints.openai.app import build_app

__all__ = ["build_app", "drain", "run_server"]

logger = logging.getLogger(__name__)

#: Seconds between two looks at the in-flight requests while draining.
DRAIN_POLL_S = 0.05


async def drain(app: Any, grace_period: float) -> int:
    """Graceful drain: refuse new requests (503, ``ServerLifecycle.draining``), let the
    in-flight ones finish for up to ``grace_period`` seconds, then abort the rest (streams get
    an error event and ``[DONE]``, waiting clients 503 ``request_aborted``).

    Returns:
        the number of requests aborted when the grace period ran out.
    """
    app.state.lifecycle.draining = True
    engine: AsyncLLMEngine = app.state.async_engine
    logger.info(
        "draining: %d request(s) in flight, up to %.1f s to finish",
        engine.num_live_requests,
        grace_period,
    )
    end = time.monotonic() + grace_period
    while engine.num_live_requests and time.monotonic() < end:
        await asyncio.sleep(DRAIN_POLL_S)
    left = engine.num_live_requests
    if left:
        logger.warning("grace period over: aborting %d request(s)", left)
        engine.abort_all(RequestAbortedError("the server is shutting down"))
    return left


def _dashboard_enabled(args: Any) -> bool:
    """KV dashboard: on for loopback hosts, elsewhere only with ``--enable-dashboard``."""
    from pagedllm.entrypoints.openai.debug_routes import dashboard_enabled

    return dashboard_enabled(args.host, getattr(args, "enable_dashboard", False))


def run_server(args: Any) -> int:
    """``pagedllm serve``: load the model, serve until SIGINT / SIGTERM, then exit 0.

    On the first signal the server drains (``drain``): new requests get 503 with
    ``Retry-After`` (``/health`` too), in-flight ones may finish for ``--shutdown-grace-period``
    seconds, then the rest are aborted (streams get an error event and ``[DONE]``) and the
    process exits. A second signal aborts everything at once.

    Returns:
        0 after a normal shutdown, 2 when the engine could not be built (bad arguments, missing
        model; logged).
    """
    import uvicorn

    from pagedllm.entrypoints.cli import engine_kwargs

    if getattr(args, "extra_model", None) or getattr(args, "model_dir", None):
        from pagedllm.serving.multi_model_cli import serve_multi_model

        return serve_multi_model(args, engine_kwargs(args))
    try:
        app = build_app(
            engine_kwargs(args),
            served_model_name=args.served_model_name,
            api_key=args.api_key,
            max_body_bytes=args.max_body_bytes,
            log_stats_interval=args.log_stats_interval,
            enable_dashboard=_dashboard_enabled(args),
            tool_call_parser=getattr(args, "tool_call_parser", None),
            data_parallel_size=getattr(args, "data_parallel_size", 1),
            router_policy=getattr(args, "router_policy", "cache_aware"),
        )
    except (ValueError, FileNotFoundError) as e:
        logger.error("could not start the engine: %s", e)
        return 2
    async_engine: AsyncLLMEngine = app.state.async_engine
    grace_period = float(getattr(args, "shutdown_grace_period", 0.0))

    class _Server(uvicorn.Server):
        draining: concurrent.futures.Future | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:  # no re-raise of the signal: exit 0
            loop = async_engine.event_loop
            if self.draining is None and grace_period > 0 and loop is not None:
                self.draining = asyncio.run_coroutine_threadsafe(self._drain(), loop)
                return
            async_engine.abort_all_threadsafe(RequestAbortedError("the server is shutting down"))
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                self.should_exit = True

        async def _drain(self) -> None:
            await drain(app, grace_period)
            self.should_exit = True

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=5,
    )
    server = _Server(config)
    logger.info(
        "serving %s on http://%s:%d (OpenAI API under /v1)",
        app.state.serving.model_name,
        args.host,
        args.port,
    )
    server.run()
    return 0
