"""The loop a remote tensor-parallel rank runs (multi-process executor, ``spawn`` context)."""

from __future__ import annotations

import contextlib
import pickle
import sys
import traceback
from multiprocessing.connection import Connection

from pagedllm.executor.base import WorkerInit, build_worker


def worker_main(
    conn: Connection, init: WorkerInit, rank: int, world_size: int, port: int, backend: str
) -> None:
    """Join the group, build the shard, say "ready", then run every step the driver sends.

    Messages from the driver are pickled ``SchedulerOutput`` bytes; a pickled None (or a closed
    pipe) ends the loop. Nothing is sent back per step: rank 0's logits stay in the driver. On an
    exception the traceback is sent as ("error", text) and the process exits with code 1.
    """
    import torch

    from pagedllm.device import activate_device, device_for_rank
    from pagedllm.distributed import create_store, init_tensor_parallel_group

    try:
        torch.set_num_threads(init.num_threads)
        activate_device(device_for_rank(init.device, rank))  # NCCL binds to the current GPU
        store = create_store("127.0.0.1", port, is_master=False)
        group = init_tensor_parallel_group(store, rank, world_size, backend)
        worker = build_worker(init, group)
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
