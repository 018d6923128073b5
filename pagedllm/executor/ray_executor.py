"""Tensor parallelism with Ray actors as the remote ranks (paper section 4.6).

Same design as the multi-process executor: this process is the driver and rank 0; ranks
1 .. tp - 1 are Ray actors that join the same gloo (CPU) / nccl (CUDA) group over a TCP store
on a port the OS picks, and all-reduce among themselves and with the driver. Each step the driver
pickles the ``SchedulerOutput`` once and passes the same bytes to every actor's ``execute``; only
the driver samples.

Faults: a monitor thread pings the actors (threaded actors answer while a step runs). When one is
gone the monitor records a ``WorkerDiedError`` and kills the other actors, so the driver's
collective fails instead of hanging, and ``execute_model`` raises the recorded error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.distributed import ParallelContext, create_store, host_ip, init_parallel_groups
from pagedllm.executor.base import DriverStepMixin, WorkerDiedError, WorkerInit
from pagedllm.worker.model_runner import ModelRunnerOutput
from pagedllm.worker.worker import Worker

logger = logging.getLogger(__name__)

_PING_INTERVAL_S = 0.5
_PING_TIMEOUT_S = 30.0
_FAILURE_WAIT_S = 5.0


class RankActor:
    """One remote rank inside a Ray actor (wrapped with ``ray.remote`` at run time)."""

    def __init__(self) -> None:
        self.worker: Worker | None = None

    def setup(
        self,
        init: WorkerInit,
        rank: int,
        tp: int,
        pp: int,
        store_host: str,
        port: int,
        backend: str,
    ) -> tuple[int, str]:
        """Join the groups (over the driver's store at ``store_host``, binding this node's own
        address: ``$PAGEDLLM_HOST_IP`` or the one Ray reports) and build this rank's shard;
        returns the actor's process id and the address it bound."""
        import ray
        import torch

        torch.set_num_threads(init.num_threads)
        from pagedllm.device import activate_device, device_for_rank
        from pagedllm.executor.base import build_worker

        activate_device(device_for_rank(init.device, rank))

        host = host_ip(ray.util.get_node_ip_address())
        store = create_store(store_host, port, is_master=False)
        ctx = init_parallel_groups(store, rank, tp, pp, backend, host)
        self.worker = build_worker(init, ctx)
        return os.getpid(), host

    def execute(self, data: bytes) -> None:
        """Run one step from the pickled ``SchedulerOutput`` (the logits stay here: unused)."""
        assert self.worker is not None
        self.worker.execute_model(pickle.loads(data))

    def ping(self) -> bool:
        return True


class RayExecutor(DriverStepMixin):
    """Driver (rank 0, in this process) plus tp - 1 Ray actors.

    Uses the running Ray instance, or connects to the cluster at ``$RAY_ADDRESS`` (an existing
    multi-node cluster), or starts a local one; the executor disconnects (or stops the local one)
    at shutdown. Actors are spread over the cluster's nodes (Ray's SPREAD strategy); each binds its
    node's address (``$PAGEDLLM_HOST_IP`` on that node, else the one Ray reports) and the TCP store
    is served on the driver's address.

    Args:
        make_driver_worker: builds rank 0's ``Worker`` once the groups are joined.
        worker_inits: one ``WorkerInit`` per remote rank (ranks 1 .. tp * pp - 1).
        backend: "gloo" or "nccl".
        pipeline_parallel_size: stages (``distributed.pipeline`` lays the ranks out).
        start_timeout_s: seconds for the actors to load and join.

    Raises:
        ImportError: Ray is not installed (``pip install ray``).
        WorkerDiedError: an actor failed during start-up.
    """

    def __init__(
        self,
        make_driver_worker: Callable[[ParallelContext], Worker],
        worker_inits: list[WorkerInit],
        backend: str = "gloo",
        start_timeout_s: float = 600.0,
        pipeline_parallel_size: int = 1,
    ) -> None:
        import ray

        self._ray = ray
        self.world_size = len(worker_inits) + 1
        self.pp = pipeline_parallel_size
        self.tp = self.world_size // self.pp
        self.last_message_bytes = 0
        self.bytes_sent = 0
        self._closed = False
        self._failure: WorkerDiedError | None = None
        self._failed = threading.Event()
        self._stop = threading.Event()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray and os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        elif self._owns_ray:
            ray.init(include_dashboard=False, log_to_driver=False)
        self.driver_worker: Worker | None = None
        self._monitor: threading.Thread | None = None
        self._actors: list[Any] = []
        self.host = host = host_ip(ray.util.get_node_ip_address())
        self._store: Any = create_store(host, 0)
        # Actors import this same pagedllm (not an installed copy elsewhere).
        code_root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (code_root, os.environ.get("PYTHONPATH")) if p)
        actor_cls = ray.remote(RankActor).options(
            num_cpus=1,
            max_concurrency=2,
            scheduling_strategy="SPREAD",
            runtime_env={"env_vars": {"PYTHONPATH": path}},
        )
        try:
            self._actors = [actor_cls.remote() for _ in worker_inits]
            refs = [
                a.setup.remote(init, rank, self.tp, self.pp, host, self._store.port, backend)
                for rank, (a, init) in enumerate(zip(self._actors, worker_inits, strict=True), 1)
            ]
            group = self._join(refs, backend, start_timeout_s)
            self.driver_worker = make_driver_worker(group)
            started = ray.get(refs, timeout=start_timeout_s)
            self.pids = [pid for pid, _ in started]
            #: The address each remote rank bound (ranks 1 ..), for logs and tests.
            self.rank_hosts = [h for _, h in started]
        except BaseException:
            self.shutdown()
            raise
        self._monitor = threading.Thread(
            target=self._watch, name="pagedllm-ray-monitor", daemon=True
        )
        self._monitor.start()

    def _join(self, refs: list[Any], backend: str, timeout_s: float) -> ParallelContext:
        box: dict[str, Any] = {}

        def join() -> None:
            try:
                box["group"] = init_parallel_groups(
                    self._store, 0, self.tp, self.pp, backend, self.host
                )
            except BaseException as exc:
                box["error"] = exc

        th = threading.Thread(target=join, daemon=True)
        th.start()
        waited = 0.0
        while th.is_alive():
            th.join(0.2)
            waited += 0.2
            done, _ = self._ray.wait(refs, num_returns=len(refs), timeout=0)
            for ref in done:  # an actor that finished setup early can only have failed
                try:
                    self._ray.get(ref)
                except Exception as exc:
                    rank = refs.index(ref) + 1
                    raise WorkerDiedError(rank, None, str(exc)) from exc
            if waited > timeout_s:
                raise TimeoutError("Ray tensor-parallel actors did not join the process group")
        if "error" in box:
            raise box["error"]
        return box["group"]

    def _watch(self) -> None:
        ray = self._ray
        while not self._stop.wait(_PING_INTERVAL_S):
            for rank, actor in enumerate(self._actors, start=1):
                try:
                    ray.get(actor.ping.remote(), timeout=_PING_TIMEOUT_S)
                except ray.exceptions.GetTimeoutError:
                    continue
                except Exception as exc:
                    if self._stop.is_set():
                        return
                    self._failure = WorkerDiedError(rank, None, f"Ray actor lost: {exc}")
                    logger.error("%s; stopping the other actors", self._failure)
                    self._kill_actors()
                    self._failed.set()
                    return

    def _kill_actors(self) -> None:
        for actor in self._actors:
            with contextlib.suppress(Exception):  # already gone
                self._ray.kill(actor)

    def _raise_failure(self, cause: BaseException) -> None:
        if self._failed.wait(_FAILURE_WAIT_S) and self._failure is not None:
            raise self._failure from cause
        self._stop.set()
        self._kill_actors()
        raise cause

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Send the step to every actor, run rank 0's shard, return rank 0's logits.

        Raises:
            WorkerDiedError: an actor died (now or earlier); all actors are then stopped.
        """
        data, driver = self._encode_step(sched)
        refs = [a.execute.remote(data) for a in self._actors]
        try:
            out = driver.execute_model(sched)
            self._ray.get(refs, timeout=_PING_TIMEOUT_S)
        except Exception as exc:
            self._raise_failure(exc)
            raise
        return out

    def shutdown(self) -> None:
        """Kill the actors (and the Ray instance if this executor started it); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(_PING_TIMEOUT_S)
        self._kill_actors()
        self._actors = []
        self.driver_worker = None
        self._store = None
        if self._owns_ray:
            self._ray.shutdown()
