"""``AsyncLLMEngine``: the synchronous ``LLMEngine`` driven by one background thread, for asyncio.

Design:
- One dedicated thread owns the ``LLMEngine``: it is the only code that touches it after start-up.
  Adds and aborts from the event loop are funnelled through a thread-safe command queue that the
  thread drains between steps (``engine_commands``), so new requests join the running batch at the next step and a
  step (blocking CPU work, 10-300 ms) never runs on the event loop.
- What the server reads about the engine is plain data: immutable facts copied at construction
  (``model_facts.ModelFacts``: ``tokenizer`` -- a private copy --, ``max_model_len``,
  ``vocab_size``, ``model``, ``memory_bytes``...), the
  ``counters`` the thread publishes after every step (``kv_snapshot.EngineCounters``), and KV
  snapshots taken on the thread between two steps (``capture_kv``).
- Each request has its own ``asyncio.Queue``; the thread hands every ``RequestOutput`` to the
  event loop with ``call_soon_threadsafe``. Outputs are cumulative (text only grows), so a slow
  consumer simply skips to the newest one.
- A consumer that goes away (client disconnect -> task cancelled, or the stream closed early)
  aborts its request; the abort runs before the next step, freeing the request's KV blocks.
- Admission control (``admission.AdmissionControl``): ``add_request`` refuses a request at once
  (``QueueFullError``, on the event loop) when the published waiting count plus the adds not yet
  taken by the thread reach ``max_waiting_requests`` (the thread checks the exact count again:
  the engine's ``add_request``), and under ``admission="slots"`` when it could not start at the
  next step (no free batch slot or KV room).
- Deadlines: a request added with ``timeout`` seconds is aborted by the thread at the first step
  boundary after ``arrival + timeout`` (its blocks freed); its consumer gets a last, finished
  output with what was generated and ``finish_reason="timeout"`` on every sample that had not
  finished (``TIMEOUT_FINISH_REASON``).
- An exception in one request's own part of a step (its sampling, speculative verification,
  beam step or output processing) fails that request alone with an ``EngineStepError`` (its
  output's ``error``); the step goes on for the others.
- An exception inside ``step()`` fails every live request with an ``EngineStepError`` and aborts
  them; the engine is kept if its block pool is consistent afterwards, otherwise it is marked dead
  (``is_dead``; ``/health`` then answers 500) and every later request fails at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from pagedllm.engine.admission import AdmissionControl
from pagedllm.engine.engine_commands import (
    AbortCommand,
    AddCommand,
    CallCommand,
    Command,
    run_commands,
)
from pagedllm.engine.kv_snapshot import EngineCounters, capture, collect_counters
from pagedllm.engine.llm_engine import (
    LLMEngine,
    QueueFullError,
    check_cache_salt,
    check_priority,
)
from pagedllm.engine.model_facts import ModelFacts, ModelFactsMixin
from pagedllm.engine.request_stream import (
    TIMEOUT_FINISH_REASON,
    EngineDeadError,
    EngineStepError,
    RequestAbortedError,
    RequestStream,
    call_soon_threadsafe,
    check_timeout,
    step_error,
    timed_out_output,
)
from pagedllm.engine.stats import log_throughput
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

#: Consecutive failed steps after which the engine is declared dead.
MAX_CONSECUTIVE_STEP_FAILURES = 3
#: Seconds the engine thread sleeps after a step that made no progress while requests are live
#: (cut short by any new command), so an engine with nothing schedulable does not spin.
NO_PROGRESS_BACKOFF_S = 0.02
__all__ = [
    "AsyncLLMEngine",
    "EngineDeadError",
    "EngineStepError",
    "QueueFullError",
    "RequestAbortedError",
    "RequestStream",
    "TIMEOUT_FINISH_REASON",
    "call_soon_threadsafe",
    "check_timeout",
]


class AsyncLLMEngine(ModelFactsMixin):
    """Serve an ``LLMEngine`` to asyncio code.

    Args:
        engine: the engine; from now on only this object's thread may call it.
        log_stats_interval: seconds between throughput log lines while busy (0 = never).

    Call ``start()`` from the event loop that will consume the outputs (``create_app``'s lifespan
    does this), and ``shutdown()`` at the end. Construct it while nothing steps ``engine``: it
    copies the tokenizer and the first ``counters`` from it.

    ``engine`` stays reachable as ``.engine`` for tests and for code running on the engine
    thread (``call_in_engine_thread``); the server uses only the public members of this class.
    """

    def __init__(self, engine: LLMEngine, log_stats_interval: float = 5.0) -> None:
        self.engine = engine
        # The engine thread decodes with its tokenizer; the event loop gets its own copy.
        self._facts = ModelFacts.of_engine(engine)
        self._policy: str = engine.config.scheduling_policy
        cfg = engine.config
        self._admission = AdmissionControl(
            cfg.admission, cfg.max_waiting_requests, cfg.max_num_seqs
        )
        self._pending_adds = 0  # adds queued on the event loop, not yet taken by the thread
        self._deadlines: dict[str, float] = {}  # engine thread only: request id -> monotonic
        self._counters: EngineCounters = collect_counters(engine)
        self.log_stats_interval = log_stats_interval
        self._cmds: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self.dead_reason: str | None = None
        self._step_failures = 0
        self.num_step_errors = 0
        self._cmd_lock = threading.Lock()
        self._exited = False
        # Set by from_factory: the thread that built the engine, waiting for start().
        self._prestarted: tuple[threading.Thread, threading.Event] | None = None

    @classmethod
    def from_factory(
        cls, factory: Callable[[], LLMEngine], log_stats_interval: float = 5.0
    ) -> AsyncLLMEngine:
        """Build the engine on the thread that will step it, and keep that thread for ``start()``.

        Why: with OpenMP, the thread that runs torch's parallel regions owns a team of worker
        threads. When the main thread loads the model (its team stays alive) and another thread
        then runs the steps, that second thread's team shares the cores with the first one's;
        measured on this 2-core machine, a batch-1 decode step stepped from a second thread took
        81 ms vs 42 ms from the thread that loaded the model. Building and stepping on one thread
        avoids the second team.

        Raises:
            whatever ``factory`` raises (the thread is gone then).
        """
        built = threading.Event()
        go = threading.Event()
        box: dict[str, Any] = {}

        def main() -> None:
            try:
                box["engine"] = factory()
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = e
                built.set()
                return
            built.set()
            go.wait()
            owner: AsyncLLMEngine = box["owner"]
            if not owner._stop:
                owner._run()

        thread = threading.Thread(target=main, name="pagedllm-engine", daemon=True)
        thread.start()
        built.wait()
        if "error" in box:
            thread.join()
            raise box["error"]
        obj = cls(box["engine"], log_stats_interval)
        box["owner"] = obj
        obj._prestarted = (thread, go)
        return obj

    # ---- facts about the model: ModelFactsMixin (tokenizer, max_model_len, ...) -----------------
    @property
    def counters(self) -> EngineCounters:
        """The newest gauges and counters, published by the engine thread after every step and
        while idle (at most 0.5 s old then). Plain data: read it from any thread."""
        return self._counters

    # ---- life cycle ------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        """Whether the engine thread is alive (started and not stopped)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop ``start()`` ran on (outputs are delivered there); None before."""
        return self._loop

    @property
    def num_live_requests(self) -> int:
        """Requests added and not yet finished or aborted (as the event loop sees them)."""
        return len(self._queues)

    @property
    def is_dead(self) -> bool:
        """Whether the engine can serve no more requests (``dead_reason`` says why)."""
        return self.dead_reason is not None

    def enable_kv_stats(self) -> None:
        """Turn on the engine's per-step paper-figure KV accounting (``LLMEngine.enable_kv_stats``;
        the dashboard's history and ``/debug/engine_stats`` read it). Before ``start()`` the
        engine thread steps nothing, so it is switched here; afterwards on the engine thread."""
        if self.is_running:
            self.call_in_engine_thread(lambda engine: engine.enable_kv_stats()).result()
        else:
            self.engine.enable_kv_stats()

    def start(self) -> None:
        """Start the engine thread; outputs are delivered to the running event loop."""
        if self.is_running:
            return
        if self._exited:
            raise EngineDeadError("an AsyncLLMEngine cannot be restarted")
        self._loop = asyncio.get_running_loop()
        self._stop = False
        if self._prestarted is not None:  # from_factory: step on the thread that built the engine
            self._thread, go = self._prestarted
            self._prestarted = None
            go.set()
            return
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort every live request (their consumers get ``RequestAbortedError``), stop the
        thread and wait for it."""
        self.abort_all(RequestAbortedError("the server is shutting down"))
        self._stop = True
        self._wake.set()
        if self._prestarted is not None:  # never started: release the waiting builder thread
            self._prestarted[1].set()
            self._prestarted = None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self.dead_reason is None:
            self.dead_reason = "the engine was shut down"

    def release(self) -> None:
        """After ``shutdown()``: drop the ``LLMEngine`` (its weights and KV pools) so that their
        memory is freed even while this object stays referenced (FastAPI keeps the route
        functions of an app, which hold it, in a module-level cache). ``engine`` is gone then.

        Raises:
            RuntimeError: the engine thread still runs (call ``shutdown()`` first).
        """
        if self.is_running:
            raise RuntimeError("release() needs the engine shut down first")
        self.__dict__.pop("engine", None)

    # ---- requests ----------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """``LLMEngine.validate_request``: check a request without queueing it (it reads only
        configuration fixed at construction, so any thread may call it). Returns the effective
        ``max_tokens``.

        Raises:
            ValueError / ContextLengthExceededError: naming the offending field first.
        """
        return self.engine.validate_request(prompt_token_ids, params)

    async def validate_request_async(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> int:
        """``validate_request``, awaitable like the data-parallel front's (whose replicas
        validate). Raises: as ``validate_request``."""
        return self.validate_request(prompt_token_ids, params)

    async def compile_structured(self, spec: StructuredOutputsParams | None) -> None:
        """Compile a structured-output constraint in the grammar threads (cached), without
        blocking the event loop or the engine thread; no-op for None.

        Raises:
            ValueError: naming ``structured_outputs.<field>`` when it does not compile.
        """
        if spec is not None:
            await asyncio.wrap_future(self.engine.structured.compile_future(spec))

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        timeout: float | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Queue a request; returns once the engine accepted it.

        Args:
            request_id / prompt / params / arrival_time / cache_salt: see
                ``LLMEngine.add_request``.
            priority: lower = served first under the priority scheduling policy.
            timeout: seconds after ``arrival_time`` (default now) at which the request is
                aborted and finished with ``TIMEOUT_FINISH_REASON``; None = no deadline.

        Raises:
            ValueError / ContextLengthExceededError: the engine rejected the request (naming
                the field: ``priority``, ``timeout``, ...).
            QueueFullError: ``max_waiting_requests`` requests are waiting already.
            EngineDeadError: the engine is not running.
        """
        self._check_alive()
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use")
        check_priority(priority, self._policy)
        check_timeout(timeout)
        check_cache_salt(cache_salt)
        prompt_len = None if isinstance(prompt, str) else len(prompt)
        self._admission.check(params, self._counters, self._pending_adds, prompt_len)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        deadline = None if timeout is None else arrival + timeout
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        self._admission.admit(request_id, params)
        stream = RequestStream(self, request_id, q)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cmd_lock:
            if self._exited:
                fut.set_exception(EngineDeadError("the engine is not running"))
            else:
                self._cmds.put(
                    AddCommand(request_id, prompt, params, arrival, priority, deadline,
                               cache_salt, fut)
                )
        self._wake.set()
        self._interrupt_decode_step()
        self._pending_adds += 1
        try:
            await asyncio.wrap_future(fut)
        except BaseException:
            # Rejected, or cancelled while waiting: the queued abort runs after the add (if any).
            stream.finished = fut.done() and not fut.cancelled() and fut.exception() is not None
            stream.close()
            raise
        finally:
            self._pending_adds -= 1
        return stream

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        timeout: float | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes (each cumulative, the last finished).

        Cancelling the consumer (or closing this generator) aborts the request. ``priority``,
        ``timeout`` and ``cache_salt``: see ``add_request``.
        """
        stream = await self.add_request(
            request_id,
            prompt,
            params,
            arrival_time,
            priority=priority,
            timeout=timeout,
            cache_salt=cache_salt,
        )
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, idempotent); its blocks are freed before the next step."""
        self._cmds.put(AbortCommand(request_id))
        self._wake.set()

    def abort_all(self, error: BaseException) -> None:
        """Fail every live request with ``error`` and abort it in the engine."""
        for rid in list(self._queues):
            self._deliver(rid, error)
            self.abort(rid)

    def abort_all_threadsafe(self, error: BaseException) -> None:
        """``abort_all(error)`` from any thread (e.g. a signal handler): scheduled on the event
        loop the engine was started from; does nothing if it was never started or is closed."""
        call_soon_threadsafe(self._loop, self.abort_all, error)

    async def capture_kv(self) -> dict[str, Any]:
        """The raw KV state (``kv_snapshot.capture``), copied on the engine thread between two
        steps (directly when the thread is not running: then nothing steps the engine).

        Raises:
            EngineDeadError: the engine thread stopped before it could take the copy.
        """
        if self.is_running:
            return await asyncio.wrap_future(self.call_in_engine_thread(capture))
        return capture(self.engine)

    def call_in_engine_thread(self, fn: Any) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread between two steps (thread-safe); the future
        gets its result. For read-only observers (the KV dashboard's snapshots): keep ``fn``
        short, it delays the next step."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cmd_lock:
            if self._exited:
                fut.set_exception(EngineDeadError("the engine is not running"))
            else:
                self._cmds.put(CallCommand(fn, fut))
        self._wake.set()
        return fut

    # ---- internals -----------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine is not available: {self.dead_reason}")
        if not self.is_running:
            raise EngineDeadError("the engine is not running")

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._admission.release(request_id)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        """From any thread: put ``item`` into the request's queue on the event loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def put() -> None:
            q = self._queues.get(request_id)
            if q is not None:
                q.put_nowait(item)
            if not isinstance(item, RequestOutput) or item.finished:  # its slots are free now
                self._admission.release(request_id)

        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            put()
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(put)

    def _interrupt_decode_step(self) -> None:
        """``interrupt_decode_for_prefill``: after queueing an add, stop the step in flight when
        it is decode-only, has run less than half a usual decode step, and the live requests
        leave a batch slot (model.step_interrupt); the engine thread then takes the add and runs
        the decodes again with its prefill (or after it, with prefill_first)."""
        core = getattr(self.engine, "engine_core", None)
        interrupt = getattr(core, "step_interrupt", None)
        if core is None or interrupt is None:
            return
        in_flight = core.step_in_flight
        if in_flight is None or not in_flight[1]:
            return
        if self._admission.live_seqs > self._admission.max_num_seqs:
            return
        if time.monotonic() - in_flight[0] < 0.5 * core.decode_step_seconds:
            interrupt.request()

    def _drain_commands(self, reject: BaseException | None = None) -> None:
        run_commands(self.engine, self._cmds, self._deadlines, reject)

    def _run(self) -> None:
        try:
            self._loop_forever()
        except BaseException as e:  # a bug in this loop: never leave consumers waiting forever
            logger.exception("the engine thread crashed")
            self.dead_reason = f"the engine thread crashed: {e!r}"
            err = EngineDeadError(self.dead_reason)
            for rid in list(self._queues):
                self._deliver(rid, err)
        finally:
            # Leaving: refuse queued adds, abort whatever is left so no block stays allocated.
            with self._cmd_lock:
                self._exited = True
                self._drain_commands(reject=EngineDeadError(self.dead_reason or "engine stopped"))
            for rid in list(getattr(self.engine, "requests", {})):
                with contextlib.suppress(Exception):
                    self.engine.abort_request(rid)
            self._publish_counters()

    def _loop_forever(self) -> None:
        eng = self.engine
        last_log = time.monotonic()
        last_prompt = eng.stats.prompt_tokens
        last_gen = eng.stats.generation_tokens
        while not self._stop:
            self._drain_commands()
            if self._stop:
                break
            if self._deadlines:
                self._expire_deadlines()
            if not eng.has_unfinished_requests():
                self._publish_counters()
                self._wake.wait(0.5)
                self._wake.clear()
                last_log = time.monotonic()
                last_prompt, last_gen = eng.stats.prompt_tokens, eng.stats.generation_tokens
                continue
            try:
                outputs = eng.step()
            except Exception as e:  # noqa: BLE001
                self._on_step_error(e)
                continue
            self._step_failures = 0
            failed = {o.request_id: o.error for o in outputs if o.error is not None}
            for rid, error in failed.items():
                self._deadlines.pop(rid, None)
                self._deliver(rid, step_error(error))
            if failed:
                outputs = [o for o in outputs if o.error is None]
            if not outputs and not getattr(eng.engine_core, "last_step_interrupted", False):
                # Nothing could be scheduled (e.g. waiting for blocks): sleep until a command
                # (add, abort) arrives or a short backoff passes instead of spinning a core.
                self._wake.wait(NO_PROGRESS_BACKOFF_S)
                self._wake.clear()
            self._publish_counters()  # before the outputs: a client that got its answer sees them
            for out in outputs:
                # Snapshot what the engine may still mutate (the lists are fresh copies already).
                out = replace(out, outputs=[replace(c) for c in out.outputs])
                if out.finished:
                    self._deadlines.pop(out.request_id, None)
                self._deliver(out.request_id, out)
            if self.log_stats_interval:
                now = time.monotonic()
                if now - last_log >= self.log_stats_interval:
                    log_throughput(self._counters, now - last_log, last_prompt, last_gen)
                    last_log = now
                    last_prompt, last_gen = eng.stats.prompt_tokens, eng.stats.generation_tokens

    def _expire_deadlines(self) -> None:
        """Engine thread: abort every request past its deadline (freeing its blocks) and hand
        its consumer a last, finished output (``request_stream.timed_out_output``)."""
        now = time.monotonic()
        expired = [rid for rid, deadline in self._deadlines.items() if now >= deadline]
        for rid in expired:
            del self._deadlines[rid]
            group = self.engine.requests.get(rid)
            if group is None or not self.engine.abort_request(rid):
                continue
            logger.info("request %s passed its deadline: aborted", rid)
            self._deliver(rid, timed_out_output(self.engine.output_processor.make_output(group)))
        if expired:
            self._publish_counters()

    def _publish_counters(self) -> None:
        """Engine thread: replace ``counters`` with a fresh copy (never raises)."""
        try:
            self._counters = collect_counters(self.engine)
        except Exception:
            logger.debug("collecting the engine counters failed", exc_info=True)

    def _on_step_error(self, exc: Exception) -> None:
        eng = self.engine
        self.num_step_errors += 1
        self._step_failures += 1
        logger.exception("engine step failed; failing the live requests", exc_info=exc)
        live = list(eng.requests) if hasattr(eng, "requests") else list(self._queues)
        err = step_error(exc)
        for rid in set(live) | set(self._queues):
            self._deliver(rid, err)
        try:
            for rid in live:
                eng.abort_request(rid)
            eng.block_manager.check_invariants()
            healthy = not eng.has_unfinished_requests() and (
                eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
            )
        except Exception:
            logger.exception("engine could not recover from the failed step")
            healthy = False
        if not healthy or self._step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            self.dead_reason = f"a step failed and the engine could not recover: {exc!r}"
            logger.error("engine marked dead: %s", self.dead_reason)
            self._stop = True
