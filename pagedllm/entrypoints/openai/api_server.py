"""``pagedllm serve``'s process: build the app (``app.build_app``) and run it with uvicorn until
SIGINT / SIGTERM, then drain (``shutdown.py``) and exit.

The server itself is split by responsibility: ``app.py`` (app factory), ``routes.py``,
``serving_completion.py`` / ``serving_chat.py`` / ``serving_common.py`` (the generation
endpoints), ``middleware.py``, ``errors.py``, ``logprobs.py``, ``metrics.py``, ``protocol.py`` and
``debug_routes.py`` (the KV-cache dashboard). ``build_app`` is re-exported here for the code
that imports it from this module (``tests/bench``).
"""

from __future__ import annotations

import logging
from typing import Any

from pagedllm.entrypoints.openai.app import build_app
from pagedllm.entrypoints.openai.shutdown import AppDrain, drain, serve_until_signal

__all__ = ["app_options", "build_app", "drain", "run_server"]

logger = logging.getLogger(__name__)


def _dashboard_enabled(args: Any) -> bool:
    """KV dashboard: on for loopback hosts, elsewhere only with ``--enable-dashboard``."""
    from pagedllm.entrypoints.openai.debug_routes import dashboard_enabled

    return dashboard_enabled(args.host, getattr(args, "enable_dashboard", False))


def app_options(args: Any) -> dict[str, Any]:
    """``build_app``'s keyword arguments (but the engine's) from ``pagedllm serve``'s flags."""
    return {
        "served_model_name": args.served_model_name,
        "api_key": args.api_key,
        "max_body_bytes": args.max_body_bytes,
        "log_stats_interval": args.log_stats_interval,
        "enable_dashboard": _dashboard_enabled(args),
        "tool_call_parser": getattr(args, "tool_call_parser", None),
        "trust_request_chat_template": getattr(args, "trust_request_chat_template", False),
        "data_parallel_size": getattr(args, "data_parallel_size", 1),
        "router_policy": getattr(args, "router_policy", "cache_aware"),
    }


def run_server(args: Any) -> int:
    """``pagedllm serve``: load the model, serve until SIGINT / SIGTERM, then exit 0.

    On the first signal the server drains (``shutdown.serve_until_signal``): new requests get
    503 with ``Retry-After`` (``/health`` too), in-flight ones may finish for
    ``--shutdown-grace-period`` seconds, then the rest are aborted (streams get an error event
    and ``[DONE]``) and the process exits. A second signal aborts everything at once. Several
    models (``--model A --model B``, ``--model-dir``) are served by ``multi_model_cli``, with the
    same drain.

    Returns:
        0 after a normal shutdown, 2 when the engine could not be built or the server did not
        start (bad arguments, missing model, a model over ``--models-memory-budget``; logged).
    """
    from pagedllm.entrypoints.cli import engine_kwargs

    if getattr(args, "extra_model", None) or getattr(args, "model_dir", None):
        from pagedllm.serving.multi_model_cli import serve_multi_model

        return serve_multi_model(args, engine_kwargs(args))
    try:
        app = build_app(engine_kwargs(args), **app_options(args))
    except (ValueError, FileNotFoundError) as e:
        logger.error("could not start the engine: %s", e)
        return 2
    logger.info(
        "serving %s on http://%s:%d (OpenAI API under /v1)",
        app.state.serving.model_name,
        args.host,
        args.port,
    )
    grace_period = float(getattr(args, "shutdown_grace_period", 0.0))
    started = serve_until_signal(
        app, AppDrain(app), args.host, args.port, args.uvicorn_log_level, grace_period
    )
    return 0 if started else 2
