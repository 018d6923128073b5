"""What every executor shares: the interface, the worker recipe, and the failure exception.

Design (paper section 4.6): one scheduler and block manager in the engine's process; every step
the driver sends the same ``SchedulerOutput`` to all tensor-parallel workers. The driver process is
itself rank 0 (it holds a shard and runs the forward too), so rank 0's logits never cross a
process boundary and only tp - 1 workers are remote; the only per-step message is the pickled
``SchedulerOutput``. Only the driver samples.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.distributed import ParallelContext
from pagedllm.model.config import LlamaArchConfig
from pagedllm.worker.model_runner import ModelRunnerOutput
from pagedllm.worker.worker import Worker


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker exited or failed; the engine cannot continue.

    Attributes:
        rank: the worker's rank.
        exitcode: its exit code (negative = killed by that signal), or None if unknown.
    """

    def __init__(self, rank: int, exitcode: int | None, detail: str = "") -> None:
        msg = f"tensor-parallel worker rank {rank} died (exit code {exitcode})"
        super().__init__(msg + (f": {detail}" if detail else ""))
        self.rank = rank
        self.exitcode = exitcode


class Executor(Protocol):
    """Runs one step on every worker; returns rank 0's logits."""

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...


@dataclass
class WorkerInit:
    """Everything a rank needs to build its ``Worker`` (pickled once, at start-up).

    Attributes:
        config: model shape.
        dtype: compute and cache dtype.
        num_blocks: KV blocks (the same on every rank; counted by the driver).
        block_size: tokens per block.
        max_model_len: RoPE table size (tokens).
        attention_backend: backend name.
        num_threads: torch intra-op threads per rank (max(1, cores // tp) by default).
        num_swap_blocks: host swap blocks.
        source: model file / folder to load this rank's slices from, or None.
        source_kind: "gguf" or "hf" (with ``source``).
        state_dict: this rank's slices, when the model is not loaded from a file (tests).
        device: ``EngineConfig.device``; the rank computes on ``device_for_rank(device, rank)``.
        kv_cache_dtype: KV storage dtype (None = ``dtype``).
        quantization: ``EngineConfig.quantization`` (each rank quantizes its own shard).
        pipeline_micro_batches: ``EngineConfig.pipeline_micro_batches`` (every rank splits a
            step the same way).
    """

    config: LlamaArchConfig
    dtype: torch.dtype
    num_blocks: int
    block_size: int
    max_model_len: int
    attention_backend: str
    num_threads: int
    num_swap_blocks: int
    source: Path | None = None
    source_kind: str = "gguf"
    state_dict: dict[str, torch.Tensor] = field(default_factory=dict)
    device: str = "cpu"
    kv_cache_dtype: torch.dtype | None = None
    quantization: str | None = None
    pipeline_micro_batches: int | None = None


def build_worker(init: WorkerInit, ctx: ParallelContext) -> Worker:
    """Load this rank's weight slices (from ``init.source`` or ``init.state_dict``, into host
    memory) and build the ``Worker`` with its KV-cache shard on this rank's device (its
    pipeline stage's layers only, under pipeline parallelism)."""
    from pagedllm.model.loader.sharded import load_weight_shard
    from pagedllm.model.sharding import TensorParallelShard

    group = ctx.tp_group
    tp = group.world_size if group is not None else 1
    shard = TensorParallelShard.for_rank(init.config, ctx.tp_rank, tp)
    if init.source is not None:
        state = load_weight_shard(init.source, init.source_kind, init.config, shard, init.dtype)
    else:
        state = init.state_dict
    return Worker(
        init.config,
        state,
        init.dtype,
        init.num_blocks,
        init.block_size,
        init.max_model_len,
        attention_backend=init.attention_backend,
        num_threads=init.num_threads,
        num_swap_blocks=init.num_swap_blocks,
        group=group,
        weights_sharded=group is not None,
        device=init.device,
        kv_cache_dtype=init.kv_cache_dtype,
        pipeline=ctx.pipeline,
        quantization=init.quantization,
        pipeline_micro_batches=init.pipeline_micro_batches,
    )


def threads_per_rank(num_threads: int | None, world_size: int) -> int:
    """max(1, cores // tp): the ranks share the machine's cores."""
    return max(1, (num_threads or os.cpu_count() or 1) // world_size)


class DriverStepMixin:
    """What the multi-process and Ray executors do before every step: refuse to run after a
    worker failure or shutdown, and pickle the ``SchedulerOutput`` once (the one message every
    worker gets; its size is counted in ``last_message_bytes`` / ``bytes_sent``)."""

    _failure: BaseException | None
    _closed: bool
    driver_worker: Worker | None
    last_message_bytes: int
    bytes_sent: int

    def _encode_step(self, sched: SchedulerOutput) -> tuple[bytes, Worker]:
        """Pickled ``sched`` and the driver's own worker (rank 0).

        Raises:
            WorkerDiedError (or the recorded failure): a worker died earlier.
            RuntimeError: the executor has been shut down.
        """
        if self._failure is not None:
            raise self._failure
        if self._closed or self.driver_worker is None:
            raise RuntimeError("the executor has been shut down")
        data = pickle.dumps(sched, protocol=pickle.HIGHEST_PROTOCOL)
        self.last_message_bytes = len(data)
        self.bytes_sent += len(data)
        return data, self.driver_worker
