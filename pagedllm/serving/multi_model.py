"""Several models behind one OpenAI endpoint: ``MultiModelApp`` dispatches each request to the app
of the model its body names (``model``), loading that model's app on first use and unloading it
after ``idle_unload_s`` seconds without requests.

Every model gets a complete single-model app (``app.build_app``: its own engine, or its own
data-parallel replicas, serving layer, metrics and ``/v1/responses`` store), so every endpoint and
streaming behave exactly as with one model. The front is a thin ASGI layer:

- ``POST``: the body is read, its ``model`` looked up (absent: the first model), and the request
  replayed to that model's app; an unknown name is 404 ``model_not_found`` with ``param: model``
  (OpenAI's envelope).
- ``GET /v1/models``: every configured model, loaded or not. ``GET /health``: 200 (the models load
  on demand). Other ``GET`` paths (``/metrics``, ``/version``, ``/v1/responses/{id}``...): the
  app named by the ``model`` query parameter, else the first model's.
- Budget: at most ``max_loaded`` models at once (the memory budget, counted in models: each model
  costs its weights plus its KV pool, ``--kv-cache-memory``). Loading one more unloads the least
  recently used idle model first; when every loaded model is busy the request gets 503 with
  ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.errors import APIError, overloaded

__all__ = ["MultiModelApp"]

logger = logging.getLogger(__name__)

Scope = dict[str, Any]


@dataclass
class _Slot:
    """One configured model: how to build its app, and the app while loaded."""

    name: str
    factory: Callable[[], Any]
    app: Any = None
    lifespan: Any = None
    in_flight: int = 0
    last_used: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class MultiModelApp:
    """The ASGI app serving several models (see the module doc).

    Args:
        factories: model name (the ``model`` clients send) -> a function building that model's
            FastAPI app (``build_app(..., served_model_name=name)``); the first is the default.
        idle_unload_s: unload a model after this many seconds without requests (None: never).
        max_loaded: most models loaded at once (None: no limit).
        eager: load every model at startup instead of on first use.
        api_key: when set, ``GET /v1/models`` (answered here) needs ``Authorization: Bearer
            <api_key>``, as the models' own apps require for their paths.

    Raises:
        ValueError: naming ``factories`` when empty, ``max_loaded`` / ``idle_unload_s`` when not
            positive.
    """

    def __init__(
        self,
        factories: dict[str, Callable[[], Any]],
        idle_unload_s: float | None = None,
        max_loaded: int | None = None,
        eager: bool = False,
        api_key: str | None = None,
    ) -> None:
        if not factories:
            raise ValueError("factories must name at least one model")
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"max_loaded must be >= 1, got {max_loaded}")
        if idle_unload_s is not None and not idle_unload_s > 0:
            raise ValueError(f"idle_unload_s must be > 0, got {idle_unload_s}")
        self.slots = {name: _Slot(name, f) for name, f in factories.items()}
        self.default = next(iter(self.slots))
        self.idle_unload_s = idle_unload_s
        self.max_loaded = max_loaded
        self.eager = eager
        self.api_key = api_key
        self._reaper: asyncio.Task | None = None
        self.num_loads = 0
        self.num_unloads = 0

    @property
    def loaded(self) -> list[str]:
        """Names of the models loaded now."""
        return [s.name for s in self.slots.values() if s.app is not None]

    # ---- loading ---------------------------------------------------------------------------
    async def _load(self, slot: _Slot) -> Any:
        async with slot.lock:
            if slot.app is not None:
                return slot.app
            if self.max_loaded is not None and len(self.loaded) >= self.max_loaded:
                idle = [s for s in self.slots.values() if s.app is not None and not s.in_flight]
                if not idle:
                    raise overloaded(
                        f"{self.max_loaded} model(s) are loaded and busy; retry later",
                        "model_budget_full",
                    )
                await self._unload(min(idle, key=lambda s: s.last_used))
            logger.info("loading model %s", slot.name)
            app = await asyncio.to_thread(slot.factory)
            lifespan = app.router.lifespan_context(app)
            await lifespan.__aenter__()  # starts the engine
            slot.app, slot.lifespan = app, lifespan
            slot.last_used = time.monotonic()
            self.num_loads += 1
            return app

    async def _unload(self, slot: _Slot) -> None:
        if slot.app is None:
            return
        logger.info("unloading model %s", slot.name)
        lifespan, slot.app, slot.lifespan = slot.lifespan, None, None
        await lifespan.__aexit__(None, None, None)  # stops the engine, frees its memory
        self.num_unloads += 1

    async def _reap(self) -> None:
        """Unload models idle for ``idle_unload_s``."""
        assert self.idle_unload_s is not None
        while True:
            await asyncio.sleep(min(1.0, self.idle_unload_s / 2))
            now = time.monotonic()
            for s in self.slots.values():
                if s.app is not None and not s.in_flight and now - s.last_used > self.idle_unload_s:
                    async with s.lock:
                        if not s.in_flight and now - s.last_used > self.idle_unload_s:
                            await self._unload(s)

    # ---- ASGI ------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        try:
            if scope["method"] == "GET" and scope["path"] == "/v1/models":
                self._check_key(scope)
                await self._send_json(send, 200, self._model_list())
                return
            if scope["method"] == "GET" and scope["path"] == "/health":
                await self._send_json(send, 200, None)
                return
            body = b""
            if scope["method"] == "POST":
                body = await self._read_body(receive)
                name = self._model_of_body(body)
            else:
                name = self._model_of_query(scope) or self.default
            slot = self.slots.get(name)
            if slot is None:
                raise APIError(
                    404,
                    f"The model `{name}` does not exist; this server serves {list(self.slots)}.",
                    param="model",
                    code="model_not_found",
                )
            slot.in_flight += 1
            try:
                app = await self._load(slot)
                replay = self._replay(body, receive) if scope["method"] == "POST" else receive
                await app(scope, replay, send)
            finally:
                slot.in_flight -= 1
                slot.last_used = time.monotonic()
        except APIError as e:
            await self._send_json(send, e.status, e.body(), e.headers)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                try:
                    if self.eager:
                        for s in self.slots.values():
                            await self._load(s)
                    if self.idle_unload_s is not None:
                        self._reaper = asyncio.create_task(self._reap())
                except Exception as e:  # noqa: BLE001 - reported to the server
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                if self._reaper is not None:
                    self._reaper.cancel()
                for s in self.slots.values():
                    with contextlib.suppress(Exception):
                        await self._unload(s)
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _check_key(self, scope: Scope) -> None:
        """Raises: APIError 401 when ``api_key`` is set and the request does not carry it."""
        if self.api_key is None:
            return
        headers = dict(scope.get("headers") or [])
        if headers.get(b"authorization", b"").decode() != f"Bearer {self.api_key}":
            raise APIError(401, "missing or wrong API key", code="invalid_api_key")

    def _model_list(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": n, "object": "model", "owned_by": "pagedllm", "loaded": s.app is not None}
                for n, s in self.slots.items()
            ],
        }

    def _model_of_body(self, body: bytes) -> str:
        try:
            obj = json.loads(body or b"{}")
        except ValueError:
            return self.default  # the model's app answers the JSON error
        name = obj.get("model") if isinstance(obj, dict) else None
        if name is not None and not isinstance(name, str):
            raise APIError(400, "model must be a string", param="model")
        return name or self.default

    @staticmethod
    def _model_of_query(scope: Scope) -> str | None:
        from urllib.parse import parse_qs

        values = parse_qs(scope.get("query_string", b"").decode()).get("model")
        return values[0] if values else None

    @staticmethod
    async def _read_body(receive: Any) -> bytes:
        chunks = []
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                break
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        return b"".join(chunks)

    @staticmethod
    def _replay(body: bytes, receive: Any) -> Any:
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the real channel (disconnects)

        return replay

    @staticmethod
    async def _send_json(
        send: Any, status: int, obj: Any, headers: dict[str, str] | None = None
    ) -> None:
        data = b"" if obj is None else json.dumps(obj).encode()
        hdrs = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
        ]
        hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        await send({"type": "http.response.start", "status": status, "headers": hdrs})
        await send({"type": "http.response.body", "body": data})
