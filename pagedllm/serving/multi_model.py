"""Several models behind one OpenAI endpoint: ``MultiModelApp`` dispatches each request to the app
of the model its body names (``model``), loading that model's app on first use and unloading it
after ``idle_unload_s`` seconds without requests.

Every model gets a complete single-model app (``app.build_app``: its own engine, or its own
data-parallel replicas, serving layer, metrics and ``/v1/responses`` store), so every endpoint and
streaming behave exactly as with one model. The front is a thin ASGI layer:

- ``POST``: the body is read, its ``model`` looked up (a model's name or one of its aliases;
  absent: the first model), and the request replayed to that model's app; an unknown name is 404
  ``model_not_found`` with ``param: model`` (OpenAI's envelope).
- ``GET /v1/models``: a card per served name (each model's name, then its aliases), loaded or
  not, with the fields of one model's cards (``routes.model_cards``) plus ``loaded``; ``GET
  /v1/models/{name}``: that name's entry, unchanged (404 ``model_not_found`` for a name not
  served). ``GET /health``: 200 (the models load on demand). Other ``GET`` paths
  (``/metrics``, ``/version``, ``/v1/responses/{id}``...): the app named by the ``model`` query
  parameter, else the first model's.
- Budget: at most ``max_loaded`` models at once and/or at most ``memory_budget`` bytes, each
  loaded model counted as its engine's weights + KV pools (``ModelFacts.memory_bytes``, measured
  at its first load; an estimate stands in before). Loading one more first unloads the least
  recently used idle models until it fits; when the models it would displace are busy the request
  gets 503 ``model_budget_full`` with ``Retry-After``; a model that alone exceeds the budget gets
  400 ``model_too_large`` naming ``model`` (at startup, with eager loading: the server does not
  start). A model whose real size exceeds its estimate is loaded and measured, then the others
  are unloaded to make room (or it is unloaded again and the request gets the 503): until then
  the process holds up to that model's size over the budget.
- Graceful drain (``drain``, run by ``shutdown.serve_until_signal`` on SIGTERM): new requests
  get 503 ``server_draining``, the ones the front has taken may finish for the grace period, then
  every loaded model aborts its rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedllm.engine.async_engine import call_soon_threadsafe
from pagedllm.entrypoints.openai.errors import APIError, overloaded
from pagedllm.entrypoints.openai.middleware import DRAIN_OPEN_PATHS, ServerLifecycle, send_draining
from pagedllm.entrypoints.openai.protocol import ModelCard
from pagedllm.entrypoints.openai.shutdown import drain_in_flight

MODEL_PATH_PREFIX = "/v1/models/"  # GET /v1/models/{name}

__all__ = ["MultiModelApp"]

logger = logging.getLogger(__name__)

Scope = dict[str, Any]


@dataclass
class _Slot:
    """One configured model: how to build its app, and the app while loaded.

    ``memory_bytes`` is measured at its first load (the engine's weights + KV pools) and kept
    after an unload, so a reload makes room for the real size; ``estimate_bytes`` stands in for
    it before the first load. ``root`` and ``max_model_len`` (its cards') are read at its first
    load too (None before).
    """

    name: str
    factory: Callable[[], Any]
    root: str | None = None
    max_model_len: int | None = None
    app: Any = None
    lifespan: Any = None
    in_flight: int = 0
    last_used: float = 0.0
    memory_bytes: int | None = None
    estimate_bytes: int = 0


def _engine_memory(app: Any) -> int:
    """Bytes a model's app holds: its engine's ``memory_bytes`` (0 when it has no engine)."""
    state = getattr(app, "state", None)
    engine = getattr(state, "async_engine", None)
    return int(getattr(engine, "memory_bytes", 0))


def _served_names(slots: dict[str, _Slot], aliases: dict[str, list[str]]) -> dict[str, _Slot]:
    """Every served name -> its slot: each model's name, then its aliases.

    Raises:
        ValueError: naming ``aliases`` for an unknown model or a name served twice.
    """
    unknown = sorted(set(aliases) - set(slots))
    if unknown:
        raise ValueError(f"aliases names unknown model(s) {unknown}")
    names: dict[str, _Slot] = {}
    for slot in slots.values():
        for name in (slot.name, *aliases.get(slot.name, ())):
            if name in names:
                raise ValueError(f"aliases: the name {name!r} is served twice")
            names[name] = slot
    return names


class MultiModelApp:
    """The ASGI app serving several models (see the module doc).

    Args:
        factories: model name (the ``model`` clients send) -> a function building that model's
            FastAPI app (``build_app(..., served_model_name=name)``); the first is the default.
        idle_unload_s: unload a model after this many seconds without requests (None: never).
        max_loaded: most models loaded at once (None: no limit).
        eager: load every model at startup instead of on first use (with a budget: those that
            fit, in order; the others load on first use).
        api_key: when set, ``GET /v1/models`` (answered here) needs ``Authorization: Bearer
            <api_key>``, as the models' own apps require for their paths.
        memory_budget: most bytes the loaded models may hold together, each counted as its
            engine's weights + KV pools (``memory_bytes``) (None: no limit).
        memory_estimates: model name -> bytes expected before its first load (see
            ``multi_model_cli.estimate_model_bytes``); a model without one counts 0 until loaded.
        aliases: model name -> further names it is served under (``--served-model-name``'s
            other names); its factory's app must accept them in ``model`` too
            (``served_model_name=[name, *aliases]``).

    Raises:
        ValueError: naming ``factories`` when empty, ``max_loaded`` / ``idle_unload_s`` /
            ``memory_budget`` when not positive, ``memory_estimates`` when it names an unknown
            model, ``aliases`` when it names an unknown model or a name served twice.
    """

    def __init__(
        self,
        factories: dict[str, Callable[[], Any]],
        idle_unload_s: float | None = None,
        max_loaded: int | None = None,
        eager: bool = False,
        api_key: str | None = None,
        memory_budget: int | None = None,
        memory_estimates: dict[str, int] | None = None,
        aliases: dict[str, list[str]] | None = None,
    ) -> None:
        if not factories:
            raise ValueError("factories must name at least one model")
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"max_loaded must be >= 1, got {max_loaded}")
        if idle_unload_s is not None and not idle_unload_s > 0:
            raise ValueError(f"idle_unload_s must be > 0, got {idle_unload_s}")
        if memory_budget is not None and memory_budget < 1:
            raise ValueError(f"memory_budget must be >= 1 byte, got {memory_budget}")
        unknown = sorted(set(memory_estimates or {}) - set(factories))
        if unknown:
            raise ValueError(f"memory_estimates names unknown model(s) {unknown}")
        self.slots = {name: _Slot(name, f) for name, f in factories.items()}
        for name, estimate in (memory_estimates or {}).items():
            self.slots[name].estimate_bytes = estimate
        #: Every served name (each model's, then its aliases) -> its slot.
        self.names = _served_names(self.slots, aliases or {})
        #: The ``created`` time of the model cards.
        self.created = int(time.time())
        self.default = next(iter(self.slots))
        self.idle_unload_s = idle_unload_s
        self.max_loaded = max_loaded
        self.memory_budget = memory_budget
        self.eager = eager
        self.api_key = api_key
        self.lifecycle = ServerLifecycle()
        # Loads, evictions and idle unloads one at a time: the budget is checked against a
        # stable set of loaded models, and two models never load at once.
        self._lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reaper: asyncio.Task | None = None
        self.num_loads = 0
        self.num_unloads = 0

    @property
    def loaded(self) -> list[str]:
        """Names of the models loaded now."""
        return [s.name for s in self.slots.values() if s.app is not None]

    @property
    def loaded_bytes(self) -> int:
        """Bytes the loaded models hold (their measured ``memory_bytes``)."""
        return sum(s.memory_bytes or 0 for s in self.slots.values() if s.app is not None)

    @property
    def num_in_flight(self) -> int:
        """Requests the front has taken and not yet answered (all models)."""
        return sum(s.in_flight for s in self.slots.values())

    # ---- loading within the budget ---------------------------------------------------------
    async def _get_app(self, slot: _Slot, may_evict: bool = True) -> Any:
        """``slot``'s app, loading it first when needed (see ``_load_within_budget``)."""
        if slot.app is not None:  # no await between this check and the caller's use
            return slot.app
        async with self._lock:
            if slot.app is None:
                await self._load_within_budget(slot, may_evict)
            return slot.app

    async def _load_within_budget(self, slot: _Slot, may_evict: bool) -> None:
        """Load ``slot``, unloading least recently used idle models to make room for it (its
        measured size, else its estimate), then check its measured size against the budget.

        Raises:
            APIError: 400 ``model_too_large`` (``param: model``) when the model alone exceeds
                ``memory_budget``; 503 ``model_budget_full`` (``Retry-After``) when the models
                it would displace are busy (or ``may_evict`` is off); 503 ``server_draining``.
        """
        if self.lifecycle.draining:
            raise overloaded("the server is shutting down", "server_draining")
        self._check_alone(slot)
        if not await self._make_room(slot, slot.memory_bytes or slot.estimate_bytes, may_evict):
            raise self._budget_full(slot)
        logger.info("loading model %s", slot.name)
        app = await asyncio.to_thread(slot.factory)
        lifespan = app.router.lifespan_context(app)
        await lifespan.__aenter__()  # starts the engine
        slot.app, slot.lifespan = app, lifespan
        slot.last_used = time.monotonic()
        slot.memory_bytes = _engine_memory(app)
        engine = app.state.async_engine
        slot.root, slot.max_model_len = str(engine.model or slot.name), engine.max_model_len
        self.num_loads += 1
        logger.info(
            "model %s loaded: %.1f MiB (weights + KV); %.1f MiB loaded in all%s",
            slot.name,
            slot.memory_bytes / 2**20,
            self.loaded_bytes / 2**20,
            "" if self.memory_budget is None else f" of {self.memory_budget / 2**20:.1f} MiB",
        )
        try:
            self._check_alone(slot)
            if not await self._make_room(slot, slot.memory_bytes, may_evict):
                raise self._budget_full(slot)
        except APIError:
            await self._unload(slot)
            raise

    def _check_alone(self, slot: _Slot) -> None:
        """Raises: APIError 400 naming ``model`` when ``slot``'s measured size exceeds the
        budget by itself."""
        budget = self.memory_budget
        if budget is not None and slot.memory_bytes is not None and slot.memory_bytes > budget:
            raise APIError(
                400,
                f"The model `{slot.name}` needs {slot.memory_bytes} bytes (weights + KV cache), "
                f"more than the whole --models-memory-budget of {budget} bytes.",
                param="model",
                code="model_too_large",
            )

    def _budget_full(self, slot: _Slot) -> APIError:
        used = f"{len(self.loaded)} model(s) holding {self.loaded_bytes} bytes"
        return overloaded(
            f"no room to load `{slot.name}`: {used} are busy; retry later", "model_budget_full"
        )

    def _fits(self, slot: _Slot, need: int) -> bool:
        others = [s for s in self.slots.values() if s.app is not None and s is not slot]
        if self.max_loaded is not None and len(others) + 1 > self.max_loaded:
            return False
        if self.memory_budget is None:
            return True
        return sum(s.memory_bytes or 0 for s in others) + need <= self.memory_budget

    async def _make_room(self, slot: _Slot, need: int, may_evict: bool) -> bool:
        """Unload least recently used idle models (not ``slot``) until ``slot`` fits with
        ``need`` bytes; returns whether it fits."""
        while not self._fits(slot, need):
            idle = [
                s
                for s in self.slots.values()
                if s.app is not None and s is not slot and not s.in_flight
            ]
            if not idle or not may_evict:
                return False
            await self._unload(min(idle, key=lambda s: s.last_used))
        return True

    async def _unload(self, slot: _Slot) -> None:
        if slot.app is None:
            return
        logger.info("unloading model %s", slot.name)
        app, lifespan = slot.app, slot.lifespan
        slot.app = slot.lifespan = None
        await lifespan.__aexit__(None, None, None)  # stops the engine
        engine = getattr(app.state, "async_engine", None)
        if engine is not None:
            engine.release()  # frees its weights and KV pools (FastAPI keeps the app alive)
        self.num_unloads += 1

    async def _reap(self) -> None:
        """Unload models idle for ``idle_unload_s``."""
        assert self.idle_unload_s is not None
        while True:
            await asyncio.sleep(min(1.0, self.idle_unload_s / 2))
            async with self._lock:
                now = time.monotonic()
                for s in self.slots.values():
                    idle_for = now - s.last_used
                    if s.app is not None and not s.in_flight and idle_for > self.idle_unload_s:
                        await self._unload(s)

    async def _load_eagerly(self) -> None:
        """Startup: load every model that fits, in order (the rest load on first use).

        Raises:
            APIError: a model that alone exceeds the budget (the server does not start).
        """
        for s in self.slots.values():
            try:
                await self._get_app(s, may_evict=False)
            except APIError as e:
                if e.code != "model_budget_full":
                    raise
                logger.info("model %s left for its first request: %s", s.name, e.message)

    # ---- graceful drain (shutdown.serve_until_signal) --------------------------------------
    @property
    def event_loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop the front serves on (set at startup)."""
        return self._loop

    async def drain(self, grace_period: float) -> int:
        """Refuse new requests (503 ``server_draining``; ``/metrics`` and ``/version`` stay open),
        let the in-flight ones finish for up to ``grace_period`` seconds, then abort the rest on
        every loaded model. Returns how many were aborted."""
        self.lifecycle.draining = True
        return await drain_in_flight(lambda: self.num_in_flight, self.abort_all, grace_period)

    def abort_all(self, error: BaseException) -> None:
        """Fail every live request of every loaded model with ``error``."""
        for s in self.slots.values():
            engine = getattr(getattr(s.app, "state", None), "async_engine", None)
            if engine is not None:
                engine.abort_all(error)

    def abort_all_threadsafe(self, error: BaseException) -> None:
        """``abort_all`` from any thread (a signal handler)."""
        call_soon_threadsafe(self._loop, self.abort_all, error)

    # ---- ASGI ------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if self.lifecycle.draining and scope["path"] not in DRAIN_OPEN_PATHS:
            await send_draining(send)
            return
        try:
            if scope["method"] == "GET" and scope["path"] == "/v1/models":
                self._check_key(scope)
                await self._send_json(send, 200, self._model_list())
                return
            if scope["method"] == "GET" and scope["path"].startswith(MODEL_PATH_PREFIX):
                self._check_key(scope)
                await self._send_json(send, 200, self._model_card(scope["path"]))
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
            slot = self.names.get(name)
            if slot is None:
                raise self._unknown_model(name)
            slot.in_flight += 1
            try:
                app = await self._get_app(slot)
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
                self._loop = asyncio.get_running_loop()
                try:
                    if self.eager:
                        await self._load_eagerly()
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
        return {"object": "list", "data": [self._card(n) for n in self.names]}

    def _card(self, name: str) -> dict[str, Any]:
        """The card of served name ``name`` (a model's or an alias)."""
        slot = self.names[name]
        card = ModelCard(
            id=name, created=self.created, root=slot.root, max_model_len=slot.max_model_len
        )
        return {**card.model_dump(), "loaded": slot.app is not None}

    def _model_card(self, path: str) -> dict[str, Any]:
        """``GET /v1/models/{name}``: that name's ``GET /v1/models`` entry. Raises: APIError
        404 for a name not served."""
        name = path.removeprefix(MODEL_PATH_PREFIX)
        if name not in self.names:
            raise self._unknown_model(name)
        return self._card(name)

    def _unknown_model(self, name: str) -> APIError:
        """The 404 ``model_not_found`` for a name this server does not serve."""
        return APIError(
            404,
            f"The model `{name}` does not exist; this server serves {list(self.names)}.",
            param="model",
            code="model_not_found",
        )

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
