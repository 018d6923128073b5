"""Pipeline parallelism: the layer split across stages, the stage-to-stage links, and the
tensor-parallel x pipeline-parallel layout of the ranks.

Layout (Megatron-LM's, as vLLM uses it): world = tp * pp ranks; global rank ``r`` is tensor-parallel
rank ``r % tp`` of stage ``r // tp``. Each stage has its own tensor-parallel group; activations go
from tensor-parallel rank ``t`` of stage ``s`` to rank ``t`` of stage ``s + 1`` (their hidden
states are replicated within a stage, so every rank sends its own copy), by point-to-point
send/recv over one group spanning the world. The last stage's rank 0 sends the logits back to the
driver (global rank 0), which alone samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedllm.distributed.parallel_state import (
    DEFAULT_TIMEOUT_S,
    LOOPBACK,
    TensorParallelGroup,
    new_process_group,
)


def stage_layer_range(num_layers: int, stage: int, num_stages: int) -> range:
    """The contiguous decoder layers stage ``stage`` holds: ``num_layers // num_stages`` each,
    the first ``num_layers % num_stages`` stages one more.

    Raises:
        ValueError: naming ``pipeline_parallel_size`` when there are fewer layers than stages.
    """
    if num_stages > num_layers:
        raise ValueError(
            f"pipeline_parallel_size ({num_stages}) must be <= the number of layers ({num_layers})"
        )
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def max_stage_layers(num_layers: int, num_stages: int) -> int:
    """Layers of the largest stage: the KV pool is sized by it (num_blocks = min over stages)."""
    return len(stage_layer_range(num_layers, 0, num_stages))


class PipelineGroup:
    """This rank's place in the pipeline and its links to the neighbouring stages.

    Args:
        pg: a backend group spanning all ``tp * pp`` ranks (point-to-point only).
        rank: global rank.
        tp: tensor-parallel size (ranks per stage).
        pp: pipeline-parallel size (stages).

    Attributes:
        stage: 0 .. pp - 1; is_first / is_last: this stage is the first / last.
    """

    def __init__(self, pg: object, rank: int, tp: int, pp: int) -> None:
        self.pg = pg
        self.rank = rank
        self.tp = tp
        self.num_stages = pp
        self.stage = rank // tp
        self.is_first = self.stage == 0
        self.is_last = self.stage == pp - 1
        self.is_driver = rank == 0
        # Rank 0 of the last stage holds the gathered logits and sends them to the driver.
        self.sends_output = self.is_last and rank % tp == 0

    def _p2p(self, t: torch.Tensor, peer: int, send: bool, tag: int) -> PendingOp:
        """Post a send / receive of ``t`` and return at once; ``wait()`` the result. Both sides
        know the shape, so an empty tensor moves nothing. Each (micro-batch, kind) has its own
        ``tag``, so receives posted ahead of time match their sends whatever the order."""
        if t.numel() == 0:
            return PendingOp(t, None)
        op = self.pg.send if send else self.pg.recv  # type: ignore[attr-defined]
        return PendingOp(t, op([t], peer, tag))

    def send_next(self, t: torch.Tensor, tag: int = 0) -> PendingOp:
        """Post a send of ``t`` (made contiguous) to the same tensor-parallel rank of the next
        stage."""
        return self._p2p(t.contiguous(), self.rank + self.tp, True, tag)

    def recv_prev(self, t: torch.Tensor, tag: int = 0) -> PendingOp:
        """Post a receive into ``t`` (its shape and dtype agreed in advance) from the previous
        stage."""
        return self._p2p(t, self.rank - self.tp, False, tag)

    def send_to_driver(self, t: torch.Tensor, tag: int = 0) -> PendingOp:
        """Last stage, rank 0: post a send of ``t`` to the driver (global rank 0)."""
        return self._p2p(t.contiguous(), 0, True, tag)

    def recv_from_last(self, t: torch.Tensor, tag: int = 0) -> PendingOp:
        """Driver: post a receive into ``t`` from the last stage's rank 0."""
        return self._p2p(t, (self.num_stages - 1) * self.tp, False, tag)


class PendingOp:
    """A posted point-to-point send or receive: ``wait()`` blocks until it completed and returns
    its tensor (a receive's buffer is filled then). Keeps the tensor alive meanwhile."""

    def __init__(self, tensor: torch.Tensor, work: object | None) -> None:
        self.tensor = tensor
        self._work = work

    def wait(self) -> torch.Tensor:
        """Block until done; the tensor (filled, for a receive)."""
        if self._work is not None:
            self._work.wait()  # type: ignore[attr-defined]
            self._work = None
        return self.tensor


@dataclass
class ParallelContext:
    """The groups one rank belongs to.

    Attributes:
        rank: global rank (0 = the driver).
        tp_group: this stage's tensor-parallel group; None when tp = 1.
        pipeline: the pipeline links; None when pp = 1.
    """

    rank: int
    tp_group: TensorParallelGroup | None
    pipeline: PipelineGroup | None

    @property
    def tp_rank(self) -> int:
        """Rank inside the stage's tensor-parallel group."""
        return self.tp_group.rank if self.tp_group is not None else 0


def init_parallel_groups(
    store: dist.Store,
    rank: int,
    tp: int,
    pp: int,
    backend: str = "gloo",
    host: str = LOOPBACK,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> ParallelContext:
    """Join this rank's tensor-parallel group (its stage's) and the pipeline group; blocks until
    every rank of each group joined. Groups are separated inside ``store`` by key prefixes.

    Args:
        store: the rendezvous store (the driver serves it).
        rank: global rank, 0 .. tp * pp - 1.
        tp, pp: tensor- and pipeline-parallel sizes (tp * pp >= 2).
        backend: "gloo" or "nccl".
        host: this rank's own address (gloo binds to it).

    Raises:
        ValueError: naming ``rank`` when out of range, or ``backend``.
    """
    world = tp * pp
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    tp_group = None
    if tp > 1:
        stage = rank // tp
        sub = dist.PrefixStore(f"tp{stage}/", store)
        pg = new_process_group(sub, rank % tp, tp, backend, timeout_s, host)
        tp_group = TensorParallelGroup(pg, rank % tp, tp)
    pipeline = None
    if pp > 1:
        pg = new_process_group(
            dist.PrefixStore("pp/", store), rank, world, backend, timeout_s, host
        )
        pipeline = PipelineGroup(pg, rank, tp, pp)
    return ParallelContext(rank, tp_group, pipeline)
