"""``LocalServer``: an app served by uvicorn on a free 127.0.0.1 port in a thread of this process
(the soak and overload benchmarks drive it and read its engine directly)."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType
from typing import Any


class LocalServer:
    """Serve ``app`` on 127.0.0.1 (a free port) in a daemon thread; use as a context manager.

    Args:
        app: an ASGI app (``create_app`` / ``build_app``); its lifespan starts the engine.
        start_timeout_s: how long ``__enter__`` waits for the server to accept connections.

    Attributes:
        url: ``http://127.0.0.1:<port>`` once entered.

    Raises:
        RuntimeError: from ``__enter__`` when the server did not start in time.
    """

    def __init__(self, app: Any, start_timeout_s: float = 120.0) -> None:
        import uvicorn

        self.app = app
        self.start_timeout_s = start_timeout_s
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="error", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def __enter__(self) -> LocalServer:
        self._thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() - t0 > self.start_timeout_s:
                raise RuntimeError("the local server did not start")
            time.sleep(0.02)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.server.should_exit = True
        self._thread.join(30)
