"""One request's side of ``AsyncLLMEngine``: the errors its consumer may get, the ``timeout``
check, handing items to the consumer's event loop, and ``RequestStream`` (the async iterator
over its outputs)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pagedllm.outputs import RequestOutput

if TYPE_CHECKING:
    from pagedllm.engine.async_engine import AsyncLLMEngine

#: ``finish_reason`` of a sample cut by its request's deadline (``timeout``).
TIMEOUT_FINISH_REASON = "timeout"


def timed_out_output(out: RequestOutput) -> RequestOutput:
    """The last output of a request aborted at its deadline: finished, what it generated, and
    ``TIMEOUT_FINISH_REASON`` on the samples that had not finished (or were aborted)."""
    outputs = [
        replace(c, finish_reason=TIMEOUT_FINISH_REASON)
        if c.finish_reason in (None, "abort")
        else c
        for c in out.outputs
    ]
    return replace(out, outputs=outputs, finished=True)


def check_timeout(timeout: float | None) -> None:
    """Raises: ValueError naming ``timeout`` unless it is None or a finite number > 0
    (seconds)."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ValueError(f"timeout must be a number of seconds, got {timeout!r}")
    if not 0 < timeout < float("inf"):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout}")


def call_soon_threadsafe(
    loop: asyncio.AbstractEventLoop | None, fn: Callable[..., Any], *args: Any
) -> None:
    """Schedule ``fn(*args)`` on ``loop`` from any thread (a signal handler); nothing when
    ``loop`` is None (never started) or closed."""
    if loop is not None and not loop.is_closed():
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(fn, *args)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (a fatal error or shutdown); no request can be served."""


class EngineStepError(RuntimeError):
    """A step of the engine raised while this request was live; the request was aborted."""


def step_error(exc: BaseException | str) -> EngineStepError:
    """What the consumer of a request that ``exc`` failed inside a step gets (a 500); ``exc``
    may be the exception or its "ExceptionType: message" (``RequestOutput.error``)."""
    what = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    return EngineStepError(f"internal engine error: {what}")


class RequestAbortedError(RuntimeError):
    """The request was aborted by the server (e.g. shutdown) before it finished."""


class RequestStream:
    """Async iterator over the outputs of one request (the newest output each time).

    Closing it (``aclose``) or cancelling the task iterating it aborts the request if it has
    not finished.
    """

    def __init__(self, engine: AsyncLLMEngine, request_id: str, q: asyncio.Queue) -> None:
        self.engine = engine
        self.request_id = request_id
        self._queue = q
        self.finished = False
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self._closed:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
            # Outputs are cumulative: skip to the newest one already delivered.
            while not isinstance(item, BaseException) and not self._queue.empty():
                item = self._queue.get_nowait()
        except BaseException:
            self.close()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            self.engine._forget(self.request_id)
            raise item
        if item.finished:
            self.finished = True
            self.engine._forget(self.request_id)
        return item

    def close(self) -> None:
        """Stop listening; aborts the request in the engine unless it already finished."""
        if self._closed:
            return
        self._closed = True
        if not self.finished:
            self.engine.abort(self.request_id)
        self.engine._forget(self.request_id)

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:  # a stream dropped without being closed must not leak blocks
        try:
            if not self._closed and not self.finished:
                self.engine.abort(self.request_id)
        except Exception:
            pass
