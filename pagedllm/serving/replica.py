"""One data-parallel replica: a Ray actor owning one ``AsyncLLMEngine``.

The front process (``DataParallelEngine``) calls ``generate``, an async generator method that Ray
streams back item by item (``ObjectRefGenerator``). Its first item says whether the engine
accepted the request, so a rejection (400, 503 queue full) reaches the caller before anything
streams. Errors travel as ``WireError`` values rather than Ray task errors: the engine's exception
types (``ContextLengthExceededError`` and its ``param``) survive the trip and the serving layer
maps them to the same HTTP answers as with one engine. Cancelling the generator (``ray.cancel``)
closes the request's stream, which aborts it in the engine and frees its KV blocks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pagedllm.core.kv_manager import ContextLengthExceededError
from pagedllm.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineStepError,
    QueueFullError,
    RequestAbortedError,
)
from pagedllm.engine.kv_snapshot import EngineCounters
from pagedllm.engine.model_facts import ModelFacts
from pagedllm.sampling_params import SamplingParams

__all__ = ["EngineReplica", "WireError"]

_ERROR_TYPES: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        ValueError,
        QueueFullError,
        EngineDeadError,
        EngineStepError,
        RequestAbortedError,
    )
}


@dataclass(frozen=True)
class WireError:
    """An engine exception as plain data (some exception types do not unpickle by themselves).

    Attributes:
        kind: the exception's class name; message: ``str(exc)``; param: the field a
            ``ContextLengthExceededError`` blames (else None).
    """

    kind: str
    message: str
    param: str | None = None

    @classmethod
    def of(cls, exc: BaseException) -> WireError:
        """Encode ``exc`` (a ValueError subclass travels as ValueError, keeping its message)."""
        if isinstance(exc, ContextLengthExceededError):
            return cls("ContextLengthExceededError", str(exc), exc.param)
        for name, typ in _ERROR_TYPES.items():
            if type(exc) is typ:
                return cls(name, str(exc))
        if isinstance(exc, ValueError):
            return cls("ValueError", str(exc))
        return cls("EngineStepError", f"{type(exc).__name__}: {exc}")

    def exception(self) -> Exception:
        """The exception to raise in the front process."""
        if self.kind == "ContextLengthExceededError":
            return ContextLengthExceededError(self.message, self.param or "prompt")
        return _ERROR_TYPES.get(self.kind, EngineStepError)(self.message)


class EngineReplica:
    """The body of the replica actor (``ray.remote`` is applied by ``DataParallelEngine``).

    Args:
        engine_args: ``EngineConfig`` keyword arguments.
        loaded: a ``LoadedModel`` to serve instead of loading ``engine_args["model"]`` (tests).
        num_threads: torch threads of this replica's engine (the replica's CPU share).
        log_stats_interval: seconds between throughput log lines (0 = never).

    Raises:
        ValueError / FileNotFoundError: from ``EngineConfig`` or the model loader (the actor
            then fails to start, and the front process reports it).
    """

    def __init__(
        self,
        engine_args: dict[str, Any],
        loaded: Any = None,
        num_threads: int = 1,
        log_stats_interval: float = 0.0,
    ) -> None:
        import torch

        from pagedllm.config import EngineConfig
        from pagedllm.engine.llm_engine import LLMEngine

        torch.set_num_threads(max(1, num_threads))
        config = EngineConfig(**engine_args)
        self.engine = AsyncLLMEngine.from_factory(
            lambda: LLMEngine(config, loaded=loaded), log_stats_interval=log_stats_interval
        )

    def _ensure_started(self) -> None:
        # start() needs the actor's event loop, which exists only inside async methods.
        if not self.engine.is_running and not self.engine.is_dead:
            self.engine.start()

    async def info(self) -> ModelFacts:
        """The model facts the front process serves from (tokenizer, ``max_model_len``,
        ``block_size``, ``memory_bytes``...: ``ModelFacts``)."""
        self._ensure_started()
        return self.engine.facts

    async def ping(self) -> bool:
        """True while the engine runs (the router's health check)."""
        self._ensure_started()
        return not self.engine.is_dead

    async def counters(self) -> EngineCounters:
        """The engine's newest published counters."""
        self._ensure_started()
        return self.engine.counters

    async def validate(self, prompt: list[int], params: SamplingParams) -> tuple[str, Any]:
        """The engine's ``validate_request``, nothing queued: ``("ok", max_tokens)`` (the
        effective one: ``max_tokens=None`` is cut to what the KV pool holds) or
        ``("error", WireError)``."""
        try:
            return "ok", self.engine.validate_request(prompt, params)
        except Exception as e:  # noqa: BLE001 - sent back as data
            return "error", WireError.of(e)

    async def generate(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        priority: int = 0,
        timeout: float | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[tuple[str, Any]]:
        """Stream one request: first ``("accepted", None)`` or ``("error", WireError)``, then
        ``("output", RequestOutput)`` items (cumulative; the last one finished) or a final
        ``("error", WireError)``. The arrival time is this process's clock (now)."""
        self._ensure_started()
        try:
            stream = await self.engine.add_request(
                request_id,
                prompt,
                params,
                priority=priority,
                timeout=timeout,
                cache_salt=cache_salt,
            )
        except Exception as e:  # noqa: BLE001 - sent back as data
            yield "error", WireError.of(e)
            return
        yield "accepted", None
        try:
            async for out in stream:
                yield "output", out
        except Exception as e:  # noqa: BLE001 - sent back as data
            yield "error", WireError.of(e)
        finally:
            stream.close()  # cancelled by the router: abort, free the blocks

    async def shutdown(self) -> None:
        """Abort every request and stop the engine thread."""
        self.engine.shutdown()
