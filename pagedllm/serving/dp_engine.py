"""``DataParallelEngine``: N engine replicas (Ray actors, ``replica.EngineReplica``) behind the
router, with the public interface of ``AsyncLLMEngine`` that the OpenAI serving layer uses
(``add_request`` returning an async stream, ``abort_all``, ``counters``, the model facts), so every
endpoint works unchanged on top of it.

Life of a request: ``add_request`` asks the router (``routing.ReplicaRouter``) for a replica given
the prompt's token ids and each replica's in-flight requests, starts the replica's streaming
``generate`` and waits for its first item (accepted or rejected). A replica that fails before the
request streamed anything (its actor died) is taken out of rotation and the request is submitted to
another one; once outputs have streamed, the request fails with ``EngineDeadError`` (HTTP 503
``engine_dead``, or an error event on a stream). A monitor task pings replicas out of rotation and
puts them back once Ray has restarted them (``max_restarts``), and polls every replica's counters
(``counters`` sums them; the router's metrics show them per replica).

Shared state lives here, in the front process: admission (``max_waiting_requests`` per replica in
rotation: 503 above it), the ``/v1/responses`` store (one per app), and graceful drain
(``num_live_requests`` / ``abort_all``, both counting the requests still being routed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass, replace
from typing import Any

from pagedllm.engine.async_engine import EngineDeadError, QueueFullError, call_soon_threadsafe
from pagedllm.engine.kv_snapshot import EngineCounters
from pagedllm.engine.model_facts import ModelFactsMixin
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.serving.counters import sum_counters
from pagedllm.serving.replica import EngineReplica, WireError
from pagedllm.serving.routing import ReplicaRouter

__all__ = ["DataParallelEngine", "ReplicaState", "ReplicaStream"]

logger = logging.getLogger(__name__)

#: Seconds between two polls of the replicas' counters / pings of replicas out of rotation.
MONITOR_INTERVAL_S = 0.5
#: Seconds a ping may take before the replica counts as not (yet) back.
PING_TIMEOUT_S = 5.0


@dataclass
class ReplicaState:
    """The router's view of one replica.

    Attributes:
        index: replica id; actor: its Ray actor handle; in_rotation: whether it takes requests;
        in_flight: router-tracked live requests; counters: its newest polled counters (None before
        the first poll); failures: times it was taken out of rotation; failed_requests: requests
        that failed because it died.
    """

    index: int
    actor: Any
    in_rotation: bool = True
    in_flight: int = 0
    counters: EngineCounters | None = None
    failures: int = 0
    failed_requests: int = 0


def _ensure_ray(num_cpus: int | None) -> None:
    """Start a local Ray instance unless this process is already connected to one (then that
    cluster, e.g. ``ray start --head`` on several hosts, places the replicas)."""
    import ray

    if ray.is_initialized():
        return
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    ray.init(
        address=os.environ.get("RAY_ADDRESS") or None,
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )


class DataParallelEngine(ModelFactsMixin):
    """N replicas of one model behind the router; an ``AsyncLLMEngine`` to the serving layer.

    Args:
        engine_args: ``EngineConfig`` keyword arguments of every replica.
        num_replicas: replicas (>= 1), one Ray actor each.
        policy: ``--router-policy`` (``routing.ROUTER_POLICIES``).
        loaded: a ``LoadedModel`` every replica serves instead of loading the model (tests).
        threads_per_replica: torch threads (and Ray CPUs) per replica.
        prefix_blocks: most full KV blocks hashed into a request's routing key.
        max_restarts: restarts Ray grants a dead replica (-1 = forever).
        log_stats_interval: seconds between each replica's throughput log lines (0 = never).

    Raises:
        ValueError: naming ``num_replicas`` / ``policy``; or the replicas' own error (bad engine
            argument, missing model) when they cannot start.
    """

    def __init__(
        self,
        engine_args: dict[str, Any],
        num_replicas: int,
        policy: str = "cache_aware",
        loaded: Any = None,
        threads_per_replica: int = 1,
        prefix_blocks: int = 8,
        max_restarts: int = -1,
        log_stats_interval: float = 0.0,
    ) -> None:
        import ray

        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        _ensure_ray(None)
        # Kept referenced for the engine's life: Ray re-reads the constructor arguments from its
        # object store when it restarts a dead replica, and fails the restart once they are freed.
        self._loaded_ref = ray.put(loaded)
        actor_cls = ray.remote(
            num_cpus=threads_per_replica, max_restarts=max_restarts, max_task_retries=0
        )(EngineReplica)
        self.replicas = [
            ReplicaState(
                i,
                actor_cls.remote(
                    engine_args, self._loaded_ref, threads_per_replica, log_stats_interval
                ),
            )
            for i in range(num_replicas)
        ]
        try:
            infos = ray.get([r.actor.info.remote() for r in self.replicas])
        except ray.exceptions.RayActorError as e:
            self._kill_all()
            cause = e.__cause__ or e
            raise ValueError(f"the data-parallel replicas could not start: {cause}") from None
        # Replica 0 speaks for the model; the memory is every replica's.
        self._facts = replace(infos[0], memory_bytes=sum(f.memory_bytes for f in infos))
        self.router = ReplicaRouter(
            num_replicas, policy, block_size=self._facts.block_size, prefix_blocks=prefix_blocks
        )
        self._max_waiting: int | None = engine_args.get("max_waiting_requests")
        self._streams: set[ReplicaStream] = set()
        self._routing: set[ReplicaStream] = set()  # added, not yet accepted by a replica
        self.num_retries = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._monitor: asyncio.Task | None = None
        self._stopped = False
        self._counters = sum_counters(ray.get([r.actor.counters.remote() for r in self.replicas]))

    # ---- what the serving layer reads: ModelFactsMixin (tokenizer, max_model_len, ...) ----
    @property
    def counters(self) -> EngineCounters:
        """The replicas' counters summed (``counters.sum_counters``), at most
        ``MONITOR_INTERVAL_S`` old."""
        return self._counters

    @property
    def is_running(self) -> bool:
        """Started and not shut down."""
        return self._loop is not None and not self._stopped

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop ``start()`` ran on."""
        return self._loop

    @property
    def num_live_requests(self) -> int:
        """Requests not finished (all replicas), counting those still being routed (graceful
        drain waits for them too)."""
        return len(self._streams) + len(self._routing)

    @property
    def dead_reason(self) -> str | None:
        """Why no request can be served (shut down, or no replica in rotation); else None."""
        if self._stopped:
            return "the engine was shut down"
        if not any(r.in_rotation for r in self.replicas):
            return "no data-parallel replica is in rotation (all died; restarting)"
        return None

    @property
    def is_dead(self) -> bool:
        """Whether no request can be served now."""
        return self.dead_reason is not None

    # ---- life cycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Start the monitor on the running event loop (``create_app``'s lifespan)."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._monitor = self._loop.create_task(self._monitor_loop())

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort every request, stop the monitor and kill the replica actors."""
        self.abort_all(EngineDeadError("the server is shutting down"))
        self._stopped = True
        if self._monitor is not None:
            self._monitor.cancel()
        self._kill_all()

    def release(self) -> None:
        """Nothing to drop: the weights and KV pools live in the replica actors, which
        ``shutdown()`` killed (``AsyncLLMEngine.release``'s counterpart)."""

    def _kill_all(self) -> None:
        import ray

        for r in self.replicas:
            with contextlib.suppress(Exception):
                ray.kill(r.actor, no_restart=True)

    # ---- requests ----------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """No check here: the replica validates when it takes the request, and its ``ValueError``
        comes back unchanged from ``add_request``. Returns ``params.max_tokens`` (or 0)."""
        return params.max_tokens or 0

    async def validate_request_async(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> int:
        """``validate_request`` as one engine does it, by a replica in rotation (they are alike):
        the effective ``max_tokens`` (``None``: cut to the room the KV pool leaves), for the
        serving layer's defaults. ``validate_request``'s answer when no replica answers within
        ``PING_TIMEOUT_S`` (the request itself then gets the failure).

        Raises:
            ValueError / ContextLengthExceededError: the replica refused it (naming the field).
        """
        import ray

        for replica in self.replicas:
            if not replica.in_rotation:
                continue
            ref = replica.actor.validate.remote(list(prompt_token_ids), params)
            try:
                kind, item = await asyncio.wait_for(ref, PING_TIMEOUT_S)
            except (ray.exceptions.RayError, asyncio.TimeoutError):
                continue  # the monitor takes a dead one out of rotation
            if kind == "ok":
                return int(item)
            err = item.exception()
            if isinstance(err, ValueError):
                raise err
            break
        return self.validate_request(prompt_token_ids, params)

    async def compile_structured(self, spec: Any) -> None:
        """No-op: the replica compiles structured-output grammars when it takes the request."""

    def _admit(self) -> None:
        """Raises: QueueFullError above ``max_waiting_requests`` per replica in rotation."""
        if self._max_waiting is None:
            return
        live = [r for r in self.replicas if r.in_rotation]
        waiting = sum(r.counters.num_waiting for r in live if r.counters is not None)
        if waiting + len(self._routing) >= self._max_waiting * max(1, len(live)):
            raise QueueFullError(
                f"the server is overloaded: {waiting} requests are waiting on {len(live)} "
                "replica(s) (max_waiting_requests per replica); retry later"
            )

    async def _submit(self, stream: ReplicaStream, excluded: set[int]) -> None:
        """Route ``stream``'s request to a replica (not in ``excluded``) and wait until it is
        accepted; a replica that fails on the way is taken out of rotation and the next tried.

        Raises:
            the replica's rejection (ValueError, QueueFullError, ...), or EngineDeadError when no
            replica is left.
        """
        import ray

        last_error = "no data-parallel replica is in rotation"
        while True:
            eligible = [r.in_rotation and r.index not in excluded for r in self.replicas]
            loads = [r.in_flight for r in self.replicas]
            index = self.router.choose(stream.prompt, loads, eligible)
            if index is None:
                raise EngineDeadError(f"no replica could take the request: {last_error}")
            replica = self.replicas[index]
            gen = replica.actor.generate.remote(
                stream.request_id,
                stream.prompt,
                stream.params,
                stream.priority,
                stream.timeout,
                stream.cache_salt,
            )
            replica.in_flight += 1
            try:
                kind, item = await (await gen.__anext__())
            except (ray.exceptions.RayError, StopAsyncIteration) as e:
                replica.in_flight -= 1
                self._take_out(replica, e)
                excluded.add(index)
                last_error = f"replica {index} failed: {type(e).__name__}"
                self.num_retries += 1
                continue
            except BaseException:
                replica.in_flight -= 1
                with contextlib.suppress(Exception):
                    ray.cancel(gen)
                raise
            if kind == "error":
                replica.in_flight -= 1
                err = item.exception() if isinstance(item, WireError) else RuntimeError(item)
                if isinstance(err, QueueFullError) and any(
                    r.in_rotation and r.index not in excluded | {index} for r in self.replicas
                ):
                    excluded.add(index)  # this one is full: try another
                    continue
                raise err
            stream.attach(replica, gen)
            return

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        timeout: float | None = None,
        cache_salt: str | None = None,
    ) -> ReplicaStream:
        """Route and queue a request; returns once a replica accepted it (see the module doc).

        Raises:
            ValueError / ContextLengthExceededError: the replica rejected it (naming the field).
            QueueFullError: admission (every replica's queue is full).
            EngineDeadError: shut down, or no replica is in rotation.
        """
        if self._stopped:
            raise EngineDeadError("the engine was shut down")
        if isinstance(prompt, str):
            prompt = list(self.tokenizer(prompt).input_ids)
        self._admit()
        stream = ReplicaStream(
            self, request_id, list(prompt), params, priority, timeout, cache_salt
        )
        self._routing.add(stream)
        try:
            await self._submit(stream, set())
        finally:
            self._routing.discard(stream)
        self._streams.add(stream)  # failed meanwhile (abort_all): its consumer raises at once
        return stream

    def abort_all(self, error: BaseException) -> None:
        """Fail every live request with ``error`` and abort it on its replica (one still being
        routed fails once a replica accepted it)."""
        for s in list(self._streams | self._routing):
            s.fail(error)

    def abort_all_threadsafe(self, error: BaseException) -> None:
        """``abort_all`` from any thread (a signal handler)."""
        call_soon_threadsafe(self._loop, self.abort_all, error)

    # ---- replica health --------------------------------------------------------------------
    def _take_out(self, replica: ReplicaState, error: BaseException) -> None:
        if replica.in_rotation:
            replica.in_rotation = False
            replica.failures += 1
            replica.counters = None
            logger.warning(
                "replica %d out of rotation (%s); waiting for its restart", replica.index, error
            )

    async def _monitor_loop(self) -> None:
        """Poll counters of replicas in rotation; ping the others until they answer again."""
        while True:
            await asyncio.gather(*(self._check(r) for r in self.replicas))
            polled = [r.counters for r in self.replicas if r.counters is not None]
            if polled:
                self._counters = sum_counters(polled)
            await asyncio.sleep(MONITOR_INTERVAL_S)

    async def _check(self, replica: ReplicaState) -> None:
        import ray

        try:
            if replica.in_rotation:
                replica.counters = await asyncio.wait_for(
                    replica.actor.counters.remote(), PING_TIMEOUT_S
                )
            elif await asyncio.wait_for(replica.actor.ping.remote(), PING_TIMEOUT_S):
                replica.counters = await replica.actor.counters.remote()
                replica.in_rotation = True
                logger.info("replica %d is back in rotation", replica.index)
        except (ray.exceptions.RayError, asyncio.TimeoutError) as e:
            self._take_out(replica, e)
        except Exception:  # noqa: BLE001 - the monitor must outlive any one check
            logger.exception("health check of replica %d failed", replica.index)

    def router_metrics(self) -> Any:
        """A Prometheus collector of the router's decisions and the replicas' loads."""
        from pagedllm.serving.metrics import RouterCollector

        return RouterCollector(self)

    def replica_loads(self) -> list[dict[str, Any]]:
        """Per replica: ``in_rotation``, ``in_flight``, ``running``, ``waiting``, ``failures``,
        ``failed_requests``, ``prefix_cache_hit_rate`` (for ``/metrics`` and the benchmark)."""
        out = []
        for r in self.replicas:
            c = r.counters
            out.append(
                {
                    "in_rotation": r.in_rotation,
                    "in_flight": r.in_flight,
                    "running": c.num_running if c else 0,
                    "waiting": c.num_waiting if c else 0,
                    "failures": r.failures,
                    "failed_requests": r.failed_requests,
                    "prefix_cache_hit_rate": c.prefix_cache_hit_rate if c else None,
                }
            )
        return out


class ReplicaStream:
    """Async iterator over one routed request's outputs (``RequestStream``'s interface).

    A replica failure before the first output resubmits the request to another replica; after
    it, the stream raises ``EngineDeadError``. ``close()`` cancels the replica's generator, which
    aborts the request there.
    """

    def __init__(
        self,
        engine: DataParallelEngine,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        priority: int,
        timeout: float | None,
        cache_salt: str | None = None,
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.priority = priority
        self.timeout = timeout
        self.cache_salt = cache_salt
        self.finished = False
        self._closed = False
        self._streamed = False
        self._replica: ReplicaState | None = None
        self._gen: Any = None
        # Set by fail() (abort_all, drain): the consumer raises it.
        self._failure: asyncio.Future = asyncio.get_running_loop().create_future()
        self._tried: set[int] = set()

    def attach(self, replica: ReplicaState, gen: Any) -> None:
        """Bind the stream to the replica that accepted it."""
        self._replica, self._gen = replica, gen
        self._tried.add(replica.index)

    def __aiter__(self) -> ReplicaStream:
        return self

    def _release(self) -> None:
        if self._replica is not None:
            self._replica.in_flight -= 1
            self._replica = None
        self.engine._streams.discard(self)

    async def _next_item(self) -> tuple[str, Any]:
        return await (await self._gen.__anext__())

    async def __anext__(self) -> RequestOutput:
        import ray

        if self.finished or self._closed:
            raise StopAsyncIteration
        while True:
            nxt = asyncio.ensure_future(self._next_item())
            try:
                await asyncio.wait({nxt, self._failure}, return_when=asyncio.FIRST_COMPLETED)
            except BaseException:
                nxt.cancel()
                self.close()
                raise
            if self._failure.done():
                nxt.cancel()
                self.finished = True
                self._cancel_remote()
                self._release()
                raise self._failure.result()
            try:
                kind, item = nxt.result()
            except (ray.exceptions.RayError, StopAsyncIteration) as e:
                replica = self._replica
                self._release()
                if replica is not None:
                    replica.failed_requests += 1
                    self.engine._take_out(replica, e)
                if not self._streamed:
                    self.engine.num_retries += 1
                    try:  # nothing reached the client yet: another replica may serve it
                        await self.engine._submit(self, set(self._tried))
                    except BaseException:
                        self.finished = True
                        raise
                    self.engine._streams.add(self)
                    continue
                self.finished = True
                raise EngineDeadError(
                    f"the replica serving this request died: {type(e).__name__}"
                ) from None
            if kind == "error":
                self.finished = True
                self._release()
                raise item.exception()
            self._streamed = True
            if item.finished:
                self.finished = True
                self._release()
            return item

    def fail(self, error: BaseException) -> None:
        """Make the consumer raise ``error`` and abort the request on its replica."""
        if not self._failure.done():
            self._failure.set_result(error)

    def _cancel_remote(self) -> None:
        import ray

        if self._gen is not None:
            with contextlib.suppress(Exception):
                ray.cancel(self._gen)

    def close(self) -> None:
        """Stop listening; aborts the request on its replica unless it finished."""
        if self._closed:
            return
        self._closed = True
        if not self.finished:
            self._cancel_remote()
        self._release()

    async def aclose(self) -> None:
        self.close()
