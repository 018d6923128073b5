"""The API routes: thin functions that parse, delegate to the serving modules and answer.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (both with SSE streaming), ``POST
/v1/embeddings``, ``POST /v1/responses`` (+ ``GET /v1/responses/{id}``), ``GET
/v1/models``, ``GET /health``, ``GET /metrics``, ``POST /tokenize``, ``POST /detokenize``,
``GET /version``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from pagedllm.entrypoints.openai import (
    serving_chat,
    serving_completion,
    serving_embedding,
    serving_responses,
)
from pagedllm.entrypoints.openai.chat_render import render_request_messages
from pagedllm.entrypoints.openai.errors import ERROR_RESPONSES, APIError
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    ResponsesRequest,
    TokenizeRequest,
)
from pagedllm.entrypoints.openai.serving_common import OpenAIServing
from pagedllm.entrypoints.openai.tool_calls.schema import resolve_tools
from pagedllm.entrypoints.openai.validation import check_messages


def server_version() -> str:
    """The installed pagedllm's version ("0.1.0" when it is not installed as a package)."""
    try:
        from importlib.metadata import version

        return version("pagedllm")
    except Exception:
        return "0.1.0"


def _json_or_sse(description: str) -> dict[str, Any]:
    """OpenAPI entry of a 200 that is a JSON body, or an SSE stream with ``stream: true``."""
    return {
        "description": description,
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {"type": "string"}},
        },
    }


def make_router(serving: OpenAIServing) -> APIRouter:
    """The routes of the API, serving through ``serving``."""
    router = APIRouter()
    engine = serving.async_engine

    @router.post(
        "/v1/completions",
        responses={200: _json_or_sse("a completion or an SSE stream"), **ERROR_RESPONSES},
    )
    async def create_completion(req: CompletionRequest, raw: Request) -> Response:
        return await serving_completion.create_completion(serving, req, raw)

    @router.post(
        "/v1/chat/completions",
        responses={200: _json_or_sse("a chat completion or an SSE stream"), **ERROR_RESPONSES},
    )
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Response:
        return await serving_chat.create_chat_completion(serving, req, raw)

    @router.post("/v1/embeddings", responses=ERROR_RESPONSES)
    async def create_embedding(req: EmbeddingRequest, raw: Request) -> Response:
        return await serving_embedding.create_embedding(serving, req, raw)

    responses_store = serving_responses.ResponseStore()

    @router.post(
        "/v1/responses",
        responses={200: _json_or_sse("a response or its event stream"), **ERROR_RESPONSES},
    )
    async def create_response(req: ResponsesRequest, raw: Request) -> Response:
        return await serving_responses.create_response(serving, responses_store, req, raw)

    @router.get("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
    async def get_response(response_id: str) -> dict[str, Any]:
        return serving_responses.get_response(responses_store, response_id)

    @router.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        return ModelList(
            data=[
                ModelCard(
                    id=name, root=str(engine.model or name), max_model_len=engine.max_model_len
                )
                for name in serving.model_names
            ]
        )

    @router.get(
        "/health",
        response_class=Response,
        responses={
            200: {"description": "the engine runs (an empty body)", "content": None},
            500: {"model": ErrorResponse, "description": "the engine is dead"},
        },
    )
    async def health() -> Response:
        """200 with an empty body while the engine runs; 500 ``engine_dead`` with the reason
        otherwise."""
        if engine.is_dead or not engine.is_running:
            reason = engine.dead_reason or "the engine is not running"
            return APIError(500, reason, "server_error", code="engine_dead").response()
        return Response(status_code=200)

    @router.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        """The Prometheus text exposition."""
        data, ctype = serving.metrics.render()
        return Response(content=data, media_type=ctype)

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": server_version()}

    @router.post("/tokenize", responses=ERROR_RESPONSES)
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        serving.check_model(req.model)
        if req.messages is not None:
            check_messages(req.messages, "tokenize")
            tools = resolve_tools(req).tools or None
            ids = render_request_messages(serving.tokenizer, req, tools)
        elif req.prompt is not None:
            ids = serving.tokenize(req.prompt, req.add_special_tokens)
        else:
            raise APIError(400, "prompt or messages is required", param="prompt")
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @router.post("/detokenize", responses=ERROR_RESPONSES)
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        serving.check_model(req.model)
        vocab = engine.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens must be in [0, {vocab}), got {bad[:5]}", param="tokens")
        return {"prompt": serving.tokenizer.decode(req.tokens)}

    return router
