"""``pagedllm serve MODEL --extra-model B [--extra-model C] [--model-dir DIR]``: the command-line
side of ``MultiModelApp`` (several models behind one endpoint)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pagedllm.config import served_model_name

__all__ = ["model_paths", "serve_multi_model"]

logger = logging.getLogger(__name__)


def model_paths(args: Any) -> dict[str, str | None]:
    """Served name -> model path: ``MODEL`` (named ``--served-model-name``'s first name or its
    default), each ``--extra-model``, and each sub-folder / ``.gguf`` file of ``--model-dir``.

    Raises:
        ValueError: naming ``--model-dir`` when it is not a folder, or ``--extra-model`` when two
            models get the same name.
    """
    paths: dict[str, str | None] = {}
    first = (args.served_model_name or [served_model_name(args.model)])[0]
    paths[first] = args.model
    extra = list(getattr(args, "extra_model", None) or [])
    model_dir = getattr(args, "model_dir", None)
    if model_dir is not None:
        if not os.path.isdir(model_dir):
            raise ValueError(f"--model-dir must be a folder, got {model_dir!r}")
        for p in sorted(Path(model_dir).iterdir()):
            if p.is_dir() or p.suffix == ".gguf":
                extra.append(str(p))
    for path in extra:
        name = served_model_name(path)
        if name in paths:
            raise ValueError(f"--extra-model: two models are named {name!r}")
        paths[name] = path
    return paths


def serve_multi_model(args: Any, engine_args: dict[str, Any]) -> int:
    """Serve every model of ``model_paths(args)`` with uvicorn until SIGINT / SIGTERM (each
    model's app built by ``build_app`` with ``engine_args``, its own ``model``). Returns 0, or 2
    for bad arguments (logged)."""
    import uvicorn

    from pagedllm.entrypoints.openai.app import build_app
    from pagedllm.serving.multi_model import MultiModelApp

    try:
        paths = model_paths(args)
    except ValueError as e:
        logger.error("%s", e)
        return 2

    def factory(name: str, path: str | None) -> Callable[[], Any]:
        return lambda: build_app(
            {**engine_args, "model": path},
            served_model_name=name,
            api_key=args.api_key,
            max_body_bytes=args.max_body_bytes,
            log_stats_interval=args.log_stats_interval,
            tool_call_parser=getattr(args, "tool_call_parser", None),
            data_parallel_size=getattr(args, "data_parallel_size", 1),
            router_policy=getattr(args, "router_policy", "cache_aware"),
        )

    app = MultiModelApp(
        {name: factory(name, path) for name, path in paths.items()},
        idle_unload_s=getattr(args, "model_idle_unload_s", None),
        max_loaded=getattr(args, "max_loaded_models", None),
        eager=not getattr(args, "lazy_load_models", False),
        api_key=args.api_key,
    )
    logger.info("serving %s on http://%s:%d", list(paths), args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    return 0
