"""``pagedllm serve --model A --model B [--model-dir DIR] [--models-memory-budget 6GiB]``: the
command-line side of ``MultiModelApp`` (several models behind one endpoint). ``--extra-model B``
is an alias of a repeated ``--model``. Every model gets the same engine flags."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pagedllm.config import served_model_name

__all__ = [
    "check_model_paths",
    "estimate_model_bytes",
    "model_aliases",
    "model_paths",
    "serve_multi_model",
]

logger = logging.getLogger(__name__)

#: Files whose bytes count as a model's weights in ``estimate_model_bytes``.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def model_paths(args: Any) -> dict[str, str | None]:
    """Served name -> model path: the first ``--model`` / ``MODEL`` (named by
    ``--served-model-name``'s first name or its default), each further ``--model`` /
    ``--extra-model``, and each sub-folder / ``.gguf`` file of ``--model-dir``.

    Raises:
        ValueError: naming ``--model-dir`` when it is not a folder, or ``--model`` when two
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
            raise ValueError(f"--model: two models are named {name!r} ({paths[name]}, {path})")
        paths[name] = path
    return paths


def model_aliases(args: Any, paths: dict[str, str | None]) -> dict[str, list[str]]:
    """Served name -> its further names: ``--served-model-name``'s names after the first, for
    the first model (as with one model, every name is accepted in ``model``).

    Raises:
        ValueError: naming ``--served-model-name`` when one of them is another model's name.
    """
    first, *rest = args.served_model_name or [served_model_name(args.model)]
    clash = sorted(set(rest) & (set(paths) - {first}))
    if clash:
        raise ValueError(f"--served-model-name: {clash} also name(s) another --model")
    return {first: list(dict.fromkeys(n for n in rest if n != first))} if rest else {}


def check_model_paths(paths: dict[str, str | None]) -> None:
    """Find a missing model before the server starts (as one model's start-up does), not while
    it loads the models (uvicorn's "Application startup failed").

    Raises:
        ValueError: naming ``--model`` for a path that is neither a file / folder nor the name
            of a bundled model.
    """
    from pagedllm.model.loader.bundled import get_bundled_model, model_not_found_message

    for path in paths.values():
        if path is not None and not os.path.exists(path) and get_bundled_model(path) is None:
            raise ValueError(f"--model: {model_not_found_message(path)}")


def estimate_model_bytes(path: str | None, engine_args: dict[str, Any], replicas: int = 1) -> int:
    """Bytes a model is expected to hold before it was ever loaded: its weight files on disk
    (``WEIGHT_SUFFIXES``; 0 for a name that is no local file / folder, such as the bundled
    model) plus its KV pools (``kv_cache_memory`` + ``swap_space`` per rank), times
    ``replicas``. A lower bound when weights grow on load (bfloat16 files served in float32);
    ``MultiModelApp`` replaces it with the engine's measured size after the first load."""
    from pagedllm.config import EngineConfig

    config = EngineConfig(**engine_args)
    weights = 0
    if path is not None and os.path.isfile(path):
        weights = os.path.getsize(path)
    elif path is not None and os.path.isdir(path):
        weights = sum(
            f.stat().st_size for f in Path(path).rglob("*") if f.suffix in WEIGHT_SUFFIXES
        )
    ranks = config.tensor_parallel_size * config.pipeline_parallel_size
    kv = (config.kv_cache_memory + config.swap_space) * ranks
    return (weights + kv) * replicas


def serve_multi_model(args: Any, engine_args: dict[str, Any]) -> int:
    """Serve every model of ``model_paths(args)`` with uvicorn until SIGINT / SIGTERM (each
    model's app built by ``build_app`` with ``engine_args``, its own ``model``), draining on the
    first signal like one model (``shutdown.serve_until_signal``). Returns 0, or 2 for bad
    arguments or a failed startup (a model over the memory budget; logged)."""
    from pagedllm.entrypoints.openai.api_server import app_options
    from pagedllm.entrypoints.openai.app import build_app
    from pagedllm.entrypoints.openai.shutdown import serve_until_signal
    from pagedllm.serving.multi_model import MultiModelApp

    replicas = max(1, getattr(args, "data_parallel_size", 1))
    try:
        paths = model_paths(args)
        aliases = model_aliases(args, paths)
        check_model_paths(paths)
        estimates = {
            n: estimate_model_bytes(p, {**engine_args, "model": p}, replicas)
            for n, p in paths.items()
        }
        app = MultiModelApp(
            {
                name: _factory(
                    build_app, engine_args, app_options(args), [name, *aliases.get(name, [])], path
                )
                for name, path in paths.items()
            },
            idle_unload_s=getattr(args, "model_idle_unload_s", None),
            max_loaded=getattr(args, "max_loaded_models", None),
            eager=not getattr(args, "lazy_load_models", False),
            api_key=args.api_key,
            memory_budget=getattr(args, "models_memory_budget", None),
            memory_estimates=estimates,
            aliases=aliases,
        )
    except ValueError as e:
        logger.error("%s", e)
        return 2
    logger.info("serving %s on http://%s:%d", list(paths), args.host, args.port)
    grace_period = float(getattr(args, "shutdown_grace_period", 0.0))
    started = serve_until_signal(
        app, app, args.host, args.port, args.uvicorn_log_level, grace_period
    )
    return 0 if started else 2


def _factory(
    build_app: Callable[..., Any],
    engine_args: dict[str, Any],
    options: dict[str, Any],
    names: list[str],
    path: str | None,
) -> Callable[[], Any]:
    """A function building the app of the model served as ``names`` (its name, then its
    aliases): the same flags, its own path and names."""
    return lambda: build_app(
        {**engine_args, "model": path}, **{**options, "served_model_name": names}
    )
