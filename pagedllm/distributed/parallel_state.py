"""One tensor-parallel process group: rank, world size, all-reduce and gather to rank 0.

Workers synchronize only through these collectives (paper section 4.6): an all-reduce after each
row-parallel linear layer and after the vocabulary-parallel embedding, and one gather of the
vocabulary-sharded logits to rank 0 (the driver), which alone samples.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600.0
#: Environment variable that overrides the address this node's ranks bind (multi-node).
HOST_IP_ENV = "PAGEDLLM_HOST_IP"
LOOPBACK = "127.0.0.1"


def host_ip(default: str = LOOPBACK) -> str:
    """The address this node's ranks bind: ``$PAGEDLLM_HOST_IP`` when set, else ``default``
    (the Ray executor passes the node address Ray reports; one-host executors the loopback)."""
    return os.environ.get(HOST_IP_ENV) or default


def create_store(
    host: str = LOOPBACK,
    port: int = 0,
    is_master: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dist.TCPStore:
    """The rendezvous key-value store of a tensor-parallel group.

    Args:
        host: address of the master (rank 0's machine).
        port: TCP port; 0 on the master lets the OS choose a free one (read it back from
            ``store.port``).
        is_master: True on rank 0, which serves the store.
        timeout_s: seconds to wait for the master or for a key.
    """
    return dist.TCPStore(
        host,
        port,
        None,
        is_master,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


class TensorParallelGroup:
    """The ranks that hold shards of one model, and the collectives between them.

    Args:
        pg: a torch.distributed ``ProcessGroup`` backend object (gloo or nccl).
        rank: this process's rank (0 = the driver, which samples).
        world_size: tensor-parallel size.
    """

    def __init__(self, pg: Any, rank: int, world_size: int) -> None:
        self.pg = pg
        self.rank = rank
        self.world_size = world_size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` (any shape, contiguous) over the ranks, in place; returns ``t``.

        Every element is the same sum of the same addends on every rank and for every tensor
        size: two ranks use the backend's all-reduce (a + b == b + a bitwise); three or more
        gather all parts and add them in rank order, because a ring all-reduce (gloo) starts
        each chunk's sum at a different rank and the chunks follow the tensor's size, so an
        element's bits would depend on how many rows the step had (a speculative verify pass
        of k + 1 rows then differed from a one-row decode: greedy tokens under tp 3 in
        bfloat16, logprobs in float32).
        """
        if self.world_size <= 2:
            self.pg.allreduce([t]).wait()
            return t
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        self.pg.allgather([parts], [t]).wait()
        t.copy_(parts[0])
        for part in parts[1:]:
            t.add_(part)
        return t

    def gather_last_dim(self, t: torch.Tensor) -> torch.Tensor | None:
        """Gather every rank's [..., n] shard (same shape on all ranks) to rank 0.

        Returns:
            On rank 0 the shards concatenated along the last dimension, [..., world_size * n];
            None on the other ranks.
        """
        t = t.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank == 0:
            outs = [torch.empty_like(t) for _ in range(self.world_size)]
            self.pg.gather([outs], [t], opts).wait()
            return torch.cat(outs, dim=-1)
        self.pg.gather([], [t], opts).wait()
        return None


def new_process_group(
    store: dist.Store,
    rank: int,
    world_size: int,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    host: str = LOOPBACK,
) -> Any:
    """A torch.distributed backend group (no global default group) over ``store``; gloo binds
    its device to ``host``, this rank's address.

    Raises:
        ValueError: naming ``backend`` when it is neither "gloo" nor "nccl".
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, rank, world_size, opts)
    if backend == "nccl":
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, nccl_opts)
    raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
