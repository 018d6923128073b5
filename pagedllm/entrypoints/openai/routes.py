"""The API routes: thin functions that parse, delegate to the serving modules and answer.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (both with SSE streaming), ``POST
/v1/embeddings``, ``POST /v1/responses`` (+ ``GET /v1/responses/{id}``), ``GET /v1/models``
(+ ``GET /v1/models/{id}``), ``GET /health``, ``GET /metrics``, ``POST /tokenize``, ``POST
/detokenize``, ``GET /version``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI, Request
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


# The endpoints are module-level functions that find the app's serving objects on
# ``request.app.state`` (``add_api_routes``), never closures over them: FastAPI keeps every
# endpoint callable it inspects in a process-wide cache, which would keep a closed-over engine
# (weights and KV pool) alive after its app is gone (the multi-model server drops an app per
# unload).
router = APIRouter()


def _serving(raw: Request) -> OpenAIServing:
    return raw.app.state.serving


@router.post(
    "/v1/completions",
    responses={200: _json_or_sse("a completion or an SSE stream"), **ERROR_RESPONSES},
)
async def create_completion(req: CompletionRequest, raw: Request) -> Response:
    return await serving_completion.create_completion(_serving(raw), req, raw)


@router.post(
    "/v1/chat/completions",
    responses={200: _json_or_sse("a chat completion or an SSE stream"), **ERROR_RESPONSES},
)
async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Response:
    return await serving_chat.create_chat_completion(_serving(raw), req, raw)


@router.post("/v1/embeddings", responses=ERROR_RESPONSES)
async def create_embedding(req: EmbeddingRequest, raw: Request) -> Response:
    return await serving_embedding.create_embedding(_serving(raw), req, raw)


@router.post(
    "/v1/responses",
    responses={200: _json_or_sse("a response or its event stream"), **ERROR_RESPONSES},
)
async def create_response(req: ResponsesRequest, raw: Request) -> Response:
    store = raw.app.state.responses_store
    return await serving_responses.create_response(_serving(raw), store, req, raw)


@router.get("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
async def get_response(response_id: str, raw: Request) -> dict[str, Any]:
    return serving_responses.get_response(raw.app.state.responses_store, response_id)


def model_cards(serving: OpenAIServing) -> list[ModelCard]:
    """One card per served name (aliases too), all of the same model: the list of ``GET
    /v1/models``, whose entries ``GET /v1/models/{id}`` answers unchanged."""
    engine = serving.async_engine
    root = str(engine.model or serving.model_name)
    return [
        ModelCard(
            id=name, created=serving.created, root=root, max_model_len=engine.max_model_len
        )
        for name in serving.model_names
    ]


@router.get("/v1/models", response_model=ModelList)
async def list_models(raw: Request) -> ModelList:
    return ModelList(data=model_cards(_serving(raw)))


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERROR_RESPONSES)
async def retrieve_model(model_id: str, raw: Request) -> ModelCard:
    """One served name's card (OpenAI's "retrieve model"), the same as its ``GET /v1/models``
    entry; 404 ``model_not_found`` for a name this server does not serve."""
    serving = _serving(raw)
    serving.check_model(model_id)
    return next(card for card in model_cards(serving) if card.id == model_id)


@router.get(
    "/health",
    response_class=Response,
    responses={
        200: {"description": "the engine runs (an empty body)", "content": None},
        500: {"model": ErrorResponse, "description": "the engine is dead"},
    },
)
async def health(raw: Request) -> Response:
    """200 with an empty body while the engine runs; 500 ``engine_dead`` with the reason
    otherwise."""
    engine = _serving(raw).async_engine
    if engine.is_dead or not engine.is_running:
        reason = engine.dead_reason or "the engine is not running"
        return APIError(500, reason, "server_error", code="engine_dead").response()
    return Response(status_code=200)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(raw: Request) -> Response:
    """The Prometheus text exposition."""
    data, ctype = _serving(raw).metrics.render()
    return Response(content=data, media_type=ctype)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": server_version()}


@router.post("/tokenize", responses=ERROR_RESPONSES)
async def tokenize(req: TokenizeRequest, raw: Request) -> dict[str, Any]:
    serving = _serving(raw)
    serving.check_model(req.model)
    if req.messages is not None and req.prompt is not None:
        raise APIError(400, "give prompt or messages, not both", param="messages")
    if req.messages is not None:
        check_messages(req.messages, "tokenize")
        tools = resolve_tools(req).tools or None
        serving.check_request_template(req.chat_template)
        ids = await serving.off_loop(render_request_messages, serving.tokenizer, req, tools)
    elif req.prompt is not None:
        ids = await serving.off_loop(serving.tokenize, req.prompt, req.add_special_tokens)
    else:
        raise APIError(400, "prompt or messages is required", param="prompt")
    return {"count": len(ids), "max_model_len": serving.async_engine.max_model_len, "tokens": ids}


@router.post("/detokenize", responses=ERROR_RESPONSES)
async def detokenize(req: DetokenizeRequest, raw: Request) -> dict[str, Any]:
    serving = _serving(raw)
    serving.check_model(req.model)
    vocab = serving.async_engine.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"tokens must be in [0, {vocab}), got {bad[:5]}", param="tokens")
    return {"prompt": serving.tokenizer.decode(req.tokens)}


def add_api_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """Serve the API routes on ``app`` through ``serving`` (kept as ``app.state.serving``, with
    the ``/v1/responses`` store as ``app.state.responses_store``)."""
    app.state.serving = serving
    app.state.responses_store = serving_responses.ResponseStore()
    app.include_router(router)
