"""``pagedllm serve``'s process: build the app (``app.build_app``) and run it with uvicorn until
SIGINT / SIGTERM.

The server itself is split by responsibility: ``app.py`` (app factory), ``routes.py``,
``serving_completion.py`` / ``serving_chat.py`` / ``serving_common.py`` (the generation
endpoints), ``middleware.py``, ``errors.py``, ``logprobs.py``, ``metrics.py``, ``protocol.py`` and
``debug_routes.py`` (the KV-cache dashboard). ``build_app`` is re-exported here for the code
that imports it from this module (``tests/bench``).
"""

from __future__ import annotations

import logging
import signal
from typing import Any

from pagedllm.engine.async_engine import AsyncLLMEngine, RequestAbortedError
from pagedllm.entrypoints.openai.app import build_app

__all__ = ["build_app", "run_server"]

logger = logging.getLogger(__name__)


def _dashboard_enabled(args: Any) -> bool:
    """KV dashboard: on for loopback hosts, elsewhere only with ``--enable-dashboard``."""
    from pagedllm.entrypoints.openai.debug_routes import dashboard_enabled

    return dashboard_enabled(args.host, getattr(args, "enable_dashboard", False))


def run_server(args: Any) -> int:
    """``pagedllm serve``: load the model, serve until SIGINT / SIGTERM, then exit 0.

    On the signal the server stops accepting connections and aborts every in-flight request
    (streams get an error event and ``[DONE]``), so shutdown does not wait for generations.

    Returns:
        0 after a normal shutdown, 2 when the engine could not be built (bad arguments, missing
        model; logged).
    """
    import uvicorn

    from pagedllm.entrypoints.cli import engine_kwargs

    try:
        app = build_app(
            engine_kwargs(args),
            served_model_name=args.served_model_name,
            api_key=args.api_key,
            max_body_bytes=args.max_body_bytes,
            log_stats_interval=args.log_stats_interval,
            enable_dashboard=_dashboard_enabled(args),
            tool_call_parser=getattr(args, "tool_call_parser", None),
        )
    except (ValueError, FileNotFoundError) as e:
        logger.error("could not start the engine: %s", e)
        return 2
    async_engine: AsyncLLMEngine = app.state.async_engine

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:  # no re-raise of the signal: exit 0
            async_engine.abort_all_threadsafe(RequestAbortedError("the server is shutting down"))
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
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
