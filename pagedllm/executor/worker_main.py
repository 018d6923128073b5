"""The loop a remote tensor-parallel rank runs (multi-process executor: ``forkserver`` or
``spawn`` context)."""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import traceback
from multiprocessing.connection import Connection

from pagedllm.executor.base import WorkerInit, build_worker


def worker_main(
    conn: Connection,
    init: WorkerInit,
    rank: int,
    tp: int,
    pp: int,
    host: str,
    port: int,
    backend: str,
    env: tuple[dict[str, str], str],
) -> None:
    """Take the driver's environment and working directory (``env``: ``(os.environ, cwd)`` at
    start-up; a forked rank would otherwise have the fork server's), join the groups
    (tensor-parallel of its stage, pipeline), build the shard, say "ready", then run every step
    the driver sends. ``host`` is the driver's (the store's) address, which on one host is also
    this rank's.

    Messages from the driver are pickled ``SchedulerOutput`` bytes; a pickled None (or a closed
    pipe) ends the loop. Nothing is sent back per step: rank 0's logits stay in the driver. On an
    exception the traceback is sent as ("error", text) and the process exits with code 1.
    """
    os.environ.clear()
    os.environ.update(env[0])
    os.chdir(env[1])
    import torch

    from pagedllm.device import activate_device, device_for_rank
    from pagedllm.distributed import create_store, init_parallel_groups

    try:
        torch.set_num_threads(init.num_threads)
        activate_device(device_for_rank(init.device, rank))  # NCCL binds to the current GPU
        store = create_store(host, port, is_master=False)
        ctx = init_parallel_groups(store, rank, tp, pp, backend, host)
        worker = build_worker(init, ctx)
        conn.send(("ready", None))
        while True:
            try:
                data = conn.recv_bytes()
            except EOFError:
                break
            sched = pickle.loads(data)
            if sched is None:
                break
            worker.execute_model(sched)
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
        sys.exit(1)
