"""The commands the event loop sends ``AsyncLLMEngine``'s engine thread, and how the thread
carries them out between two steps: it alone touches the ``LLMEngine``, so adds, aborts and
read-only calls (``call_in_engine_thread``) wait in a thread-safe queue until the next step
boundary (``async_engine`` module docstring)."""

from __future__ import annotations

import concurrent.futures
import logging
import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class AddCommand:
    """Queue a request (``LLMEngine.add_request``); ``future`` gets None or the engine's error.
    ``deadline``: ``time.monotonic()`` seconds after which the thread aborts it (None: none)."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival: float
    priority: int
    deadline: float | None
    cache_salt: str | None
    future: concurrent.futures.Future


@dataclass
class AbortCommand:
    """Abort a request (its blocks freed); idempotent."""

    request_id: str


@dataclass
class CallCommand:
    """Run ``fn(engine)``; ``future`` gets its result or its exception."""

    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future


Command = AddCommand | AbortCommand | CallCommand


def run_commands(
    engine: LLMEngine,
    commands: queue.SimpleQueue[Command],
    deadlines: dict[str, float],
    reject: BaseException | None = None,
) -> None:
    """Engine thread: carry out every queued command, in order. An add records its deadline in
    ``deadlines``, an abort drops it. ``reject``: the thread is leaving: adds and calls get
    this exception instead (aborts still run). A cancelled future's command is skipped."""
    while True:
        try:
            cmd = commands.get_nowait()
        except queue.Empty:
            return
        if isinstance(cmd, AbortCommand):
            deadlines.pop(cmd.request_id, None)
            try:
                engine.abort_request(cmd.request_id)
            except Exception:
                logger.exception("abort of request %s failed", cmd.request_id)
            continue
        fut = cmd.future
        if not fut.set_running_or_notify_cancel():
            continue
        if reject is not None:
            fut.set_exception(reject)
            continue
        try:
            if isinstance(cmd, CallCommand):
                fut.set_result(cmd.fn(engine))
                continue
            engine.add_request(
                cmd.request_id,
                cmd.prompt,
                cmd.params,
                arrival_time=cmd.arrival,
                cache_salt=cmd.cache_salt,
                priority=cmd.priority,
            )
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            fut.set_exception(e)
            continue
        if cmd.deadline is not None:
            deadlines[cmd.request_id] = cmd.deadline
        fut.set_result(None)
