"""Multi-process tensor parallelism on one machine (paper section 4.6).

The engine's process is the driver and rank 0; ranks 1 .. tp - 1 are processes started with the
``forkserver`` context where the platform has it (else ``spawn``): the server imports torch and
pagedllm once (~4 s on 2 cores) and forks every later rank from that, so the second and later
multi-process engines of a process skip the imports; each rank then takes the driver's current
environment and working directory (the server's are from its own start). They rendezvous
through a TCP store on a free port chosen by the OS and form a gloo (CPU) or nccl (CUDA) group.
Each step the driver pickles the ``SchedulerOutput`` once, writes the same bytes to every
worker's pipe, then runs its own shard's forward; the all-reduces keep the ranks in lockstep and
the logits are gathered to rank 0.

Faults: a monitor thread waits on the workers' process sentinels. When one exits, the monitor
records a ``WorkerDiedError`` (rank, exit code, the worker's traceback if it sent one) and kills
the remaining workers, because survivors can hang inside a collective; with every peer gone the
driver's own collective fails at once, and ``execute_model`` raises the recorded error.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.distributed import ParallelContext, create_store, host_ip, init_parallel_groups
from pagedllm.executor.base import DriverStepMixin, WorkerDiedError, WorkerInit
from pagedllm.executor.worker_main import worker_main
from pagedllm.worker.model_runner import ModelRunnerOutput
from pagedllm.worker.worker import Worker

logger = logging.getLogger(__name__)

# How long execute_model waits for the monitor to name the dead worker after a collective failed.
_FAILURE_WAIT_S = 5.0
# What the fork server imports before it forks ranks: torch and the rank's own code (importing
# them starts no thread, so forking stays safe). Not the C++ kernels: a rank builds them from its
# own environment (PAGEDLLM_CPU_KERNEL_VARIANT and the cache paths).
_FORKSERVER_PRELOAD = ["pagedllm.executor.worker_main", "pagedllm.worker.worker"]


def _start_context() -> Any:
    """The multiprocessing context ranks start in: ``forkserver`` (preloaded) where available,
    else ``spawn``."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
    return ctx


class MultiprocExecutor(DriverStepMixin):
    """Driver (rank 0, in this process) plus tp - 1 worker processes (module docstring).

    Args:
        make_driver_worker: builds rank 0's ``Worker`` given its groups (called once joined).
        worker_inits: one ``WorkerInit`` per remote rank (ranks 1 .. tp * pp - 1, in order).
        backend: "gloo" (CPU) or "nccl" (CUDA).
        pipeline_parallel_size: stages (``distributed.pipeline`` lays the ranks out).
        start_timeout_s: seconds to wait for the workers to load and report ready.

    Attributes:
        last_message_bytes: size of the last pickled ``SchedulerOutput`` sent to each worker.
        bytes_sent: total bytes written to one worker's pipe so far.

    Raises:
        WorkerDiedError: a worker failed during start-up (the message holds its traceback).
        TimeoutError: the workers did not report ready within ``start_timeout_s``.
    """

    def __init__(
        self,
        make_driver_worker: Callable[[ParallelContext], Worker],
        worker_inits: list[WorkerInit],
        backend: str = "gloo",
        start_timeout_s: float = 600.0,
        pipeline_parallel_size: int = 1,
    ) -> None:
        self.world_size = len(worker_inits) + 1
        self.pp = pipeline_parallel_size
        self.tp = self.world_size // self.pp
        self.host = host_ip()
        self.last_message_bytes = 0
        self.bytes_sent = 0
        self._closing = False
        self._closed = False
        self._failure: WorkerDiedError | None = None
        self._failed = threading.Event()
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._stop_r, self._stop_w = os.pipe()
        self._monitor: threading.Thread | None = None
        self.driver_worker: Worker | None = None
        ctx = _start_context()
        self._store: Any = create_store(self.host, port=0)
        port = self._store.port
        env = (dict(os.environ), os.getcwd())
        try:
            for rank, init in enumerate(worker_inits, start=1):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=worker_main,
                    args=(child, init, rank, self.tp, self.pp, self.host, port, backend, env),
                    name=f"pagedllm-tp-rank{rank}",
                    daemon=True,
                )
                proc.start()
                child.close()
                self._procs.append(proc)
                self._conns.append(parent)
            deadline = time.monotonic() + start_timeout_s
            group = self._join_group(backend, deadline)
            self.driver_worker = make_driver_worker(group)
            self._wait_ready(deadline)
        except BaseException:
            self.shutdown()
            raise
        self._monitor = threading.Thread(
            target=self._watch, name="pagedllm-tp-monitor", daemon=True
        )
        self._monitor.start()

    # ---- start-up ----------------------------------------------------------------------------
    def _dead_worker(self) -> WorkerDiedError | None:
        for rank, (proc, conn) in enumerate(zip(self._procs, self._conns, strict=True), start=1):
            if not proc.is_alive():
                return WorkerDiedError(rank, proc.exitcode, self._error_text(conn))
        return None

    @staticmethod
    def _error_text(conn: Connection) -> str:
        try:
            while conn.poll():
                kind, payload = conn.recv()
                if kind == "error":
                    return str(payload).strip()
        except (EOFError, OSError):
            pass
        return ""

    def _join_group(self, backend: str, deadline: float) -> ParallelContext:
        """Join as rank 0 in a helper thread, watching the workers meanwhile (a worker that dies
        before joining would otherwise leave the driver waiting for the store timeout)."""
        box: dict[str, Any] = {}

        def join() -> None:
            try:
                box["group"] = init_parallel_groups(
                    self._store, 0, self.tp, self.pp, backend, self.host
                )
            except BaseException as exc:  # surfaced below
                box["error"] = exc

        th = threading.Thread(target=join, name="pagedllm-tp-join", daemon=True)
        th.start()
        while th.is_alive():
            th.join(0.1)
            dead = self._dead_worker()
            if dead is not None and th.is_alive():
                raise dead
            if time.monotonic() > deadline:
                raise TimeoutError("tensor-parallel workers did not join the process group")
        if "error" in box:
            raise box["error"]
        return box["group"]

    def _wait_ready(self, deadline: float) -> None:
        pending = dict(enumerate(self._conns, start=1))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"tensor-parallel ranks {sorted(pending)} did not start in time")
            sentinels = [self._procs[r - 1].sentinel for r in pending]
            for obj in wait(list(pending.values()) + sentinels, timeout=min(left, 1.0)):
                for rank, conn in list(pending.items()):
                    if obj is conn and conn.poll():
                        kind, payload = conn.recv()
                        if kind == "error":
                            raise WorkerDiedError(rank, None, str(payload).strip())
                        del pending[rank]
            dead = self._dead_worker()
            if dead is not None:
                raise dead

    # ---- faults ------------------------------------------------------------------------------
    def _watch(self) -> None:
        by_sentinel = {p.sentinel: r for r, p in enumerate(self._procs, start=1)}
        ready = wait([*by_sentinel, self._stop_r])
        if self._closing or self._stop_r in ready:
            return
        rank = next(by_sentinel[s] for s in ready if s in by_sentinel)
        proc = self._procs[rank - 1]
        proc.join(0.5)
        self._failure = WorkerDiedError(
            rank, proc.exitcode, self._error_text(self._conns[rank - 1])
        )
        logger.error("%s; stopping the other workers", self._failure)
        self._kill_workers()
        self._failed.set()

    def _kill_workers(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(2.0)

    def _raise_failure(self, cause: BaseException | None = None) -> None:
        """Raise the monitor's ``WorkerDiedError`` (waiting briefly for it); if no worker died,
        the driver itself failed: stop the workers (stuck in a collective) and re-raise."""
        if self._failed.wait(_FAILURE_WAIT_S) and self._failure is not None:
            raise self._failure from cause
        self._closing = True
        self._kill_workers()
        if cause is not None:
            raise cause
        raise RuntimeError("tensor-parallel executor failed")

    # ---- steps -------------------------------------------------------------------------------
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Send the step to every worker, run rank 0's shard, return rank 0's logits.

        Raises:
            WorkerDiedError: a worker died (now or earlier); all workers are then stopped.
        """
        data, driver = self._encode_step(sched)
        try:
            for conn in self._conns:
                conn.send_bytes(data)
        except OSError as exc:
            self._raise_failure(exc)
        try:
            return driver.execute_model(sched)
        except Exception as exc:
            self._raise_failure(exc)
            raise  # unreachable: _raise_failure always raises

    def shutdown(self) -> None:
        """Stop the workers (a clean exit message, then SIGKILL after 5 s) and the monitor;
        idempotent."""
        if self._closed:
            return
        self._closed = True
        self._closing = True
        end = pickle.dumps(None)
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(end)
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")
        for proc in self._procs:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        if self._monitor is not None:
            self._monitor.join(2.0)
        for conn in self._conns:
            conn.close()
        for fd in (self._stop_r, self._stop_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.driver_worker = None
        self._store = None
