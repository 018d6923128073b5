"""The app factory of the OpenAI-compatible server: ``create_app`` (over an ``AsyncLLMEngine``)
and ``build_app`` (builds the engine too).

The app's lifespan starts and stops the engine thread; ``GuardMiddleware`` checks the API key and
the body size; every error, including FastAPI's validation errors and unknown routes, is answered
with the OpenAI envelope (``errors.py``). The routes are in ``routes.py``, the KV-cache dashboard
(when enabled) in ``debug_routes.py``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.middleware import (
    DEFAULT_MAX_BODY_BYTES,
    OPEN_PATHS,
    GuardMiddleware,
    ServerLifecycle,
)
from pagedllm.entrypoints.openai.protocol import ErrorResponse
from pagedllm.entrypoints.openai.routes import add_api_routes, server_version
from pagedllm.entrypoints.openai.serving_common import OpenAIServing
from pagedllm.entrypoints.openai.tool_calls.parsers import TOOL_PARSERS

logger = logging.getLogger(__name__)


# Union members' tags in a pydantic error location ("prompt", "list[int]", 0): not field names.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _most_telling(errors: list[dict]) -> dict:
    """Of a field's errors (one per union member it failed), the one to show: a validator's own
    ``value_error`` (e.g. "must be a number, not a boolean") before a type mismatch that only
    says which member did not apply, then the deepest location."""
    if not errors:
        return {}
    field = tuple(errors[0].get("loc", ()))[:2]
    same = [e for e in errors if tuple(e.get("loc", ()))[:2] == field]
    return max(same, key=lambda e: (e.get("type") == "value_error", len(e.get("loc", ()))))


def _where(loc: list) -> str:
    """``loc`` as a dotted path of field names and indices, union tags left out."""
    return ".".join(
        str(x) for x in loc if isinstance(x, int) or (x.isidentifier() and x not in _TYPE_TAGS)
    )


def _validation_error(exc: RequestValidationError) -> APIError:
    """A 400 for a body FastAPI could not parse, with ``param`` naming the first bad field."""
    errors = list(exc.errors())
    first = _most_telling(errors)
    loc = [x if isinstance(x, int) else str(x) for x in first.get("loc", ())]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx", {}) or {}
        return APIError(400, f"the body is not valid JSON: {ctx.get('error', first.get('msg'))}")
    param = str(loc[1]) if len(loc) > 1 and loc[0] == "body" else None
    if param is None and loc[:1] == ["body"]:
        msg = f"the body must be a JSON object: {first.get('msg', 'invalid')}"
    else:
        where = _where(loc[1:] if loc[:1] == ["body"] else loc)
        msg = f"{where}: {first.get('msg', 'invalid value')}"
        if len(errors) > 1:
            msg += f" (and {len(errors) - 1} more errors)"
    return APIError(400, msg, param=param)


def _add_exception_handlers(app: FastAPI) -> None:
    """Answer every error with the OpenAI envelope."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), kind).response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        return APIError(500, f"internal error: {type(exc).__name__}", "server_error").response()


def _envelope_response(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's OpenAPI schema, corrected to what the server answers: validation errors are
    400 with the OpenAI envelope (never FastAPI's 422), and every path outside ``OPEN_PATHS``
    may answer 401 (API key) with the envelope. Cached on ``app.openapi_schema``."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    if "ErrorResponse" not in schemas:
        js = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(js.pop("$defs", {}))
        schemas["ErrorResponse"] = js
    for path, ops in spec.get("paths", {}).items():
        for op in ops.values():
            responses = op.setdefault("responses", {})
            if responses.pop("422", None) is not None and "400" not in responses:
                responses["400"] = _envelope_response("invalid request")
            if path not in OPEN_PATHS and "401" not in responses:
                responses["401"] = _envelope_response("missing or wrong API key")
    text = str(spec["paths"])
    for name in ("HTTPValidationError", "ValidationError"):
        if f"/{name}'" not in text:
            schemas.pop(name, None)
    app.openapi_schema = spec
    return spec


def create_app(
    async_engine: AsyncLLMEngine,
    served_model_name: str | list[str],
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    enable_dashboard: bool = False,
    tool_call_parser: str | None = None,
    trust_request_chat_template: bool = False,
) -> FastAPI:
    """The FastAPI app serving ``async_engine``; its lifespan starts and stops the engine thread.

    Args:
        async_engine: the engine (not started yet, or started on the loop that runs the app).
        served_model_name: the name (or names) accepted in ``model``; the first is reported.
        api_key: when set, every path except /health, /version, /metrics and the docs needs
            ``Authorization: Bearer <api_key>``.
        max_body_bytes: larger request bodies get 413.
        enable_dashboard: also serve the KV-cache dashboard (``/dashboard``, ``/debug/kv*``).
        tool_call_parser: the format of the model's tool calls under ``tool_choice="auto"``
            (``hermes``, ``qwen``, ``llama3``, ``mistral``; default: from the chat template).
        trust_request_chat_template: accept a request's own ``chat_template`` (chat,
            /tokenize); otherwise such a request is a 400 naming ``chat_template``.

    Raises:
        ValueError: naming ``tool_call_parser`` when it is not a known parser.

    ``app.state.serving`` holds the ``OpenAIServing``, ``app.state.async_engine`` the engine,
    ``app.state.lifecycle`` the ``ServerLifecycle`` (set ``draining`` to refuse new requests).
    """
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(
            f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got {tool_call_parser!r}"
        )
    serving = OpenAIServing(async_engine, served_model_name)
    serving.tool_call_parser = tool_call_parser
    serving.trust_request_chat_template = trust_request_chat_template

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            async_engine.shutdown()
            serving.close()

    app = FastAPI(
        title="pagedllm OpenAI-compatible server", version=server_version(), lifespan=lifespan
    )
    app.state.async_engine = async_engine
    app.state.lifecycle = ServerLifecycle()
    app.add_middleware(
        GuardMiddleware,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        lifecycle=app.state.lifecycle,
    )
    _add_exception_handlers(app)
    add_api_routes(app, serving)
    router_metrics = getattr(async_engine, "router_metrics", None)
    if router_metrics is not None:  # data parallel: the router's decisions and replica loads
        serving.metrics.registry.register(router_metrics())
    if enable_dashboard:
        from pagedllm.entrypoints.openai.debug_routes import mount_debug_routes

        mount_debug_routes(app, async_engine)
    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]
    return app


def build_app(
    engine_args: dict[str, Any] | None = None,
    *,
    loaded: Any = None,
    served_model_name: str | list[str] | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    log_stats_interval: float = 5.0,
    enable_dashboard: bool = False,
    tool_call_parser: str | None = None,
    trust_request_chat_template: bool = False,
    data_parallel_size: int = 1,
    router_policy: str = "cache_aware",
) -> FastAPI:
    """Build the engine from ``EngineConfig`` keyword arguments and return its app.

    Args:
        engine_args: ``EngineConfig`` fields (``model``, ``max_model_len``, ...).
        loaded: a ``LoadedModel`` to reuse instead of loading ``engine_args["model"]``.
        served_model_name: default: ``pagedllm.config.served_model_name(model)`` (a folder's
            base name, a GGUF file's stem, "SmolLM2-135M-Instruct" for the bundled model).
        api_key / max_body_bytes / enable_dashboard / tool_call_parser /
            trust_request_chat_template: see ``create_app``.
        log_stats_interval: seconds between throughput log lines while busy (0 = never).
        data_parallel_size: above 1, that many engine replicas (Ray actors) behind the router
            (``pagedllm.serving.dp_engine.DataParallelEngine``; no dashboard then).
        router_policy: the router's policy (``cache_aware``, ``round_robin``, ``least_loaded``).

    Raises:
        ValueError: an invalid ``EngineConfig``; FileNotFoundError: a missing model.
    """
    from pagedllm.config import EngineConfig
    from pagedllm.config import served_model_name as default_served_model_name

    config = EngineConfig(**(engine_args or {}))
    async_engine: Any
    if data_parallel_size > 1:
        from pagedllm.serving.dp_engine import DataParallelEngine

        async_engine = DataParallelEngine(
            engine_args or {},
            data_parallel_size,
            router_policy,
            loaded=loaded,
            log_stats_interval=log_stats_interval,
        )
        enable_dashboard = False  # the dashboard reads one engine's KV pool
    elif config.tensor_parallel_size * config.pipeline_parallel_size == 1:
        # Built on the thread that will step it (AsyncLLMEngine.from_factory: one OpenMP team).
        async_engine = AsyncLLMEngine.from_factory(
            lambda: LLMEngine(config, loaded=loaded), log_stats_interval=log_stats_interval
        )
    else:  # worker processes / Ray are started from the main thread
        async_engine = AsyncLLMEngine(
            LLMEngine(config, loaded=loaded), log_stats_interval=log_stats_interval
        )
    name = served_model_name or default_served_model_name(config.model)
    return create_app(
        async_engine,
        name,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        enable_dashboard=enable_dashboard,
        tool_call_parser=tool_call_parser,
        trust_request_chat_template=trust_request_chat_template,
    )
