"""ASGI middleware of the server: the API key check, the request body size limit and the refusal
of new requests while the server drains (``ServerLifecycle``).

All three answer with the OpenAI error envelope before any route runs: 401 ``invalid_api_key`` for a
missing / wrong ``Authorization: Bearer <key>``, 413 ``request_too_large`` for a body over the
limit (by ``Content-Length``, or counted while it is read when the header is absent), 400 for an
unparsable ``Content-Length``, 503 ``server_draining`` with ``Retry-After`` for every path but
``/metrics`` and ``/version`` once a drain started (``/health`` too, so that a load balancer stops
routing here).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from typing import Any

from pagedllm.entrypoints.openai.errors import RETRY_AFTER_S, error_body

#: Default limit of a request body, bytes.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
#: Paths that stay open when an API key is set (everything else needs it).
OPEN_PATHS = ("/health", "/version", "/metrics", "/openapi.json", "/docs", "/redoc")
#: Paths still answered while the server drains (the rest get 503).
DRAIN_OPEN_PATHS = ("/metrics", "/version")


class ServerLifecycle:
    """Whether the server drains (SIGTERM): set once by ``api_server``, read by
    ``GuardMiddleware`` on every request."""

    def __init__(self) -> None:
        self.draining = False


class _BodyTooLarge(BaseException):
    """Raised from ``receive`` (a BaseException so that no ``except Exception`` swallows it)."""


async def send_json(
    send: Callable, status: int, body: dict[str, Any], extra_headers: dict[str, str] | None = None
) -> None:
    """Answer a whole HTTP request with ``body`` as JSON through the ASGI ``send``."""
    data = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
    ]
    headers += [(k.lower().encode(), v.encode()) for k, v in (extra_headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


async def send_draining(send: Callable) -> None:
    """Refuse a request while the server drains: 503 ``server_draining`` with ``Retry-After``
    (every path but ``DRAIN_OPEN_PATHS``)."""
    await send_json(
        send,
        503,
        error_body(
            "the server is shutting down and accepts no new requests",
            "server_error",
            None,
            "server_draining",
        ),
        {"Retry-After": str(RETRY_AFTER_S)},
    )


class GuardMiddleware:
    """API key check (``Authorization: Bearer <key>``) and the request body size limit.

    Args:
        app: the wrapped ASGI app.
        api_key: when set, every path but ``OPEN_PATHS`` (and CORS preflights) needs it.
        max_body_bytes: larger bodies get 413.
        lifecycle: while ``lifecycle.draining``, requests get 503 (see the module docstring).
    """

    def __init__(
        self,
        app: Any,
        api_key: str | None,
        max_body_bytes: int,
        lifecycle: ServerLifecycle | None = None,
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.lifecycle = lifecycle or ServerLifecycle()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        if self.lifecycle.draining and path not in DRAIN_OPEN_PATHS:
            await send_draining(send)
            return
        if self.api_key and not (path in OPEN_PATHS or scope.get("method") == "OPTIONS"):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                await send_json(
                    send,
                    401,
                    error_body(
                        "invalid or missing API key (send 'Authorization: Bearer <key>')",
                        "authentication_error",
                        None,
                        "invalid_api_key",
                    ),
                )
                return
        cl = headers.get(b"content-length")
        if cl is not None:
            try:
                length = int(cl)
            except ValueError:
                await send_json(
                    send, 400, error_body("invalid Content-Length", "invalid_request_error")
                )
                return
            if length > self.max_body_bytes:
                await send_json(send, 413, self._too_large())
                return
        received = 0
        started = False

        async def limited_receive() -> dict:
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.max_body_bytes:
                    raise _BodyTooLarge()
            return msg

        async def tracking_send(msg: dict) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await send_json(send, 413, self._too_large())

    def _too_large(self) -> dict[str, Any]:
        return error_body(
            f"request body is larger than the limit of {self.max_body_bytes} bytes",
            "invalid_request_error",
            None,
            "request_too_large",
        )
