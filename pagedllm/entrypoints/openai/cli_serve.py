"""``pagedllm serve``: the OpenAI-compatible server on the command line.

Importing this module raises ImportError when the server extra (fastapi, uvicorn,
prometheus-client) is missing, so ``pagedllm`` then simply has no ``serve`` command.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from typing import Any

from pagedllm.config import parse_size, served_model_name
from pagedllm.config_cli import add_engine_args
from pagedllm.entrypoints.openai.tool_calls.parsers import TOOL_PARSERS
from pagedllm.serving.routing import ROUTER_POLICIES

for _mod in ("fastapi", "uvicorn", "prometheus_client"):
    if importlib.util.find_spec(_mod) is None:
        raise ImportError(f"pagedllm serve needs {_mod}: pip install 'pagedllm[serve]'")


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until SIGINT / SIGTERM; the engine options are ``EngineConfig``'s (see
    ``add_engine_args``). Returns the exit status."""
    from pagedllm.entrypoints.openai.api_server import run_server

    if not args.served_model_name:
        args.served_model_name = [served_model_name(args.model)]
    return run_server(args)


def _non_negative_seconds(text: str) -> float:
    """argparse type: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text}")
    return value


def _port(text: str) -> int:
    """argparse type: a TCP port, 0-65535 (0: the OS picks a free one). Checked here, before the
    model loads, rather than by the socket's bind() after it."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0-65535, got {text}")
    return value


def _size(text: str) -> int:
    """argparse type: bytes, or a size with a unit (``parse_size``: ``6GiB``, ``500MB``)."""
    try:
        value = parse_size(text, "the size")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``serve [MODEL] --host --port --served-model-name --api-key ...`` and every engine
    flag (``add_engine_args``)."""
    p = subparsers.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, ...)",
    )
    add_engine_args(p, several_models=True)
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port (default 8000)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="name(s) clients pass as `model`; the first is reported (default: the model "
        "folder's base name or GGUF file's stem, or SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("PAGEDLLM_API_KEY"),
        help="require `Authorization: Bearer KEY` on the API (default: $PAGEDLLM_API_KEY, or none)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=_size,
        default=4 * 1024 * 1024,
        help="larger request bodies get 413 (bytes, or a size such as 8MiB; default 4MiB)",
    )
    p.add_argument(
        "--log-stats-interval",
        type=float,
        default=5.0,
        help="seconds between throughput log lines while busy (0 = off)",
    )
    p.add_argument(
        "--enable-dashboard",
        action="store_true",
        help="serve the KV-cache dashboard (/dashboard, /debug/kv) on a non-loopback --host too "
        "(it is always on for 127.0.0.1 / localhost; it needs --api-key when one is set)",
    )
    p.add_argument(
        "--shutdown-grace-period",
        type=_non_negative_seconds,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM / SIGINT: refuse new requests (503) and let in-flight ones finish for "
        "up to this long, then abort the rest and exit; 0 = abort at once (default: 30)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="format of the model's tool calls under tool_choice=auto (default: from the chat "
        "template; hermes for the shipped tool template)",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat_template in chat and /tokenize requests (a Jinja template runs on "
        "the server; default: such a request is a 400)",
    )
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="serve N engine replicas (Ray actors, one CPU thread each by default) behind one "
        "endpoint and a prefix-cache-aware router (docs/scaling.md; default 1: one engine)",
    )
    p.add_argument(
        "--router-policy",
        default="cache_aware",
        choices=list(ROUTER_POLICIES),
        help="with --data-parallel-size > 1: cache_aware (a request's first full KV blocks pick "
        "the replica by consistent hashing with bounded load), round_robin or least_loaded",
    )
    p.add_argument(
        "--extra-model",
        action="append",
        default=None,
        metavar="PATH",
        help="serve this model too (the same as repeating --model; kept as an alias), routed "
        "by the request's `model` (its folder's base name / GGUF stem); repeatable "
        "(docs/scaling.md)",
    )
    p.add_argument(
        "--model-dir",
        default=None,
        metavar="DIR",
        help="serve every model folder / .gguf file in DIR too (as --model)",
    )
    p.add_argument(
        "--lazy-load-models",
        action="store_true",
        help="with several models: load each on its first request (default: all that fit the "
        "budget at startup)",
    )
    p.add_argument(
        "--model-idle-unload-s",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with several models: unload a model after this long without requests (reloaded "
        "on the next one; default: never)",
    )
    p.add_argument(
        "--max-loaded-models",
        type=int,
        default=None,
        metavar="N",
        help="with several models: most models loaded at once; loading one more unloads the "
        "least recently used idle one (default: no limit)",
    )
    p.add_argument(
        "--models-memory-budget",
        type=_size,
        default=None,
        metavar="SIZE",
        help="with several models: most bytes the loaded models may hold together, each "
        "counted as its weights + KV cache (+ swap space), e.g. 6GiB; loading one more unloads "
        "the least recently used idle ones to make room, a model larger than the whole budget "
        "is refused (400 naming `model`) (default: no limit)",
    )
    p.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    p.set_defaults(func=cmd_serve)
    return p
