"""One pipeline stage's share of a step, in micro-batches: receive a micro-batch's activations,
run this stage's layers, pass them on; the last stage computes the logits and sends them to the
driver.

Micro-batches (GPipe's schedule, Huang et al. 2019, section 2.2, forward only): the step's
sequences are split into ``m`` contiguous groups (``split_micro_batches``), each a complete
forward batch with its own attention metadata. Stage ``s`` runs micro-batch ``i`` as soon as it
has finished micro-batch ``i - 1`` and received ``i`` from stage ``s - 1``, so at pp = 2 stage 0
computes micro-batch 2 while stage 1 computes micro-batch 1. With equal micro-batches a stage
idles ``(pp - 1) / (m + pp - 1)`` of the step instead of ``(pp - 1) / pp``. The sequences of one
step are independent in the forward (copy-on-write is applied before it, and a block enters the
prefix cache only after the step that filled it), so splitting them changes no value the model
computes; the driver reassembles the logits in the step's order before sampling.

No deadlock, whatever the order the stages reach their sends: every rank posts all of the step's
receives (their shapes follow from the same ``SchedulerOutput``) before it computes anything,
each (micro-batch, kind) on its own tag, and waits for its own sends only at the end of the step.

There is no separate residual tensor to move: pagedllm's decoder layers carry the residual stream
as their output ``h`` [T, H] (model dtype), so one tensor per micro-batch crosses each stage
boundary.

Idle share: each stage adds its own compute seconds to a small float64 vector [pp] that travels
with each micro-batch's activations and comes back to the driver with its logits; the driver
adds its wall-clock time per step (``PipelineStats``), so ``1 - busy / wall`` is each stage's
idle share.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from pagedllm.attention import AttentionMetadata
from pagedllm.distributed import PipelineGroup
from pagedllm.distributed.pipeline import PendingOp
from pagedllm.model.decoder import DecoderForCausalLM, KVCaches

# Message kinds; a message's tag is micro_batch * _KINDS + kind.
_ACT, _BUSY, _LOGITS, _HIDDEN, _OUT_BUSY = range(5)
_KINDS = 5


def _tag(micro_batch: int, kind: int) -> int:
    return micro_batch * _KINDS + kind


@dataclass
class PipelineStats:
    """Driver-side totals over all steps.

    Attributes:
        busy_s: per stage, seconds spent computing (its layers, plus the LM head on the last).
        wall_s: seconds from the driver starting a step's forward to receiving its logits.
        steps: steps counted.
        micro_batches: micro-batches counted (over all steps).
    """

    busy_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    steps: int = 0
    micro_batches: int = 0

    def idle_share(self) -> list[float]:
        """Per stage, the share of the pipeline's wall time it was not computing (0 .. 1)."""
        if self.wall_s <= 0:
            return [0.0 for _ in self.busy_s]
        return [max(0.0, 1.0 - b / self.wall_s) for b in self.busy_s]


@dataclass
class MicroBatch:
    """One micro-batch's forward inputs (a complete batch: decodes first, its own metadata).

    Attributes:
        input_ids, positions: [T] int64 (read by the first stage only).
        meta: its attention metadata (slot mapping, block tables over its sequences).
        logits_rows: [S] int64 rows of its T whose logits are wanted.
        pool_rows: [P] int64 rows whose final hidden states are wanted (pooling), or None.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor
    pool_rows: torch.Tensor | None


def split_micro_batches(costs: list[int], count: int) -> list[range]:
    """Split a step's sequences (in batch order) into contiguous micro-batches.

    Args:
        costs: per sequence, its token count this step (the forward's cost grows with it).
        count: micro-batches wanted (``pipeline_micro_batches``).

    Returns:
        ``min(count, len(costs))`` (at least 1) contiguous, non-empty index ranges covering
        ``0 .. len(costs) - 1`` in order; cut ``k`` is placed where the running token sum comes
        nearest to ``k / count`` of the total. Contiguity keeps each micro-batch's decodes first.

    Raises:
        ValueError: naming ``pipeline_micro_batches`` when ``count < 1``.
    """
    if count < 1:
        raise ValueError(f"pipeline_micro_batches must be >= 1, got {count}")
    n = len(costs)
    count = max(1, min(count, n))
    prefix = [0, *itertools.accumulate(costs)]
    cuts = [0]
    for k in range(1, count):
        target = prefix[-1] * k / count
        # Leave at least one sequence for each micro-batch still to come.
        candidates = range(cuts[-1] + 1, n - (count - k) + 1)
        cuts.append(min(candidates, key=lambda j: abs(prefix[j] - target)))
    cuts.append(n)
    return [range(a, b) for a, b in itertools.pairwise(cuts)]


def run_pipeline(
    model: DecoderForCausalLM,
    pipe: PipelineGroup,
    kv: KVCaches,
    batches: list[MicroBatch],
    stats: PipelineStats,
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Run this rank's stage of one step, micro-batch after micro-batch.

    Args:
        kv: this stage's per-layer caches.
        batches: the step's micro-batches, in order (the same on every rank).
        stats: the driver's totals (updated on the driver only).

    Returns:
        per micro-batch, (logits [S, V] float32, hidden [P, H] model dtype or None) on the
        driver; on the other ranks an empty [S, 0] tensor and None.
    """
    start = time.perf_counter()
    width, stages = model.config.hidden_size, pipe.num_stages
    incoming: list[tuple[PendingOp, PendingOp]] = []
    if not pipe.is_first:
        for i, b in enumerate(batches):
            h_buf = torch.empty(b.input_ids.numel(), width, dtype=model.dtype)
            busy_buf = torch.zeros(stages, dtype=torch.float64)
            incoming.append(
                (pipe.recv_prev(h_buf, _tag(i, _ACT)), pipe.recv_prev(busy_buf, _tag(i, _BUSY)))
            )
    outputs = _post_output_receives(model, pipe, batches) if pipe.is_driver else []
    sends: list[PendingOp] = []
    for i, b in enumerate(batches):
        h_in, busy = None, torch.zeros(stages, dtype=torch.float64)
        if incoming:
            h_in, busy = incoming[i][0].wait(), incoming[i][1].wait()
        t0 = time.perf_counter()
        h = model.run_layers(b.input_ids, b.positions, kv, b.meta, h=h_in)
        if not pipe.is_last:
            busy[pipe.stage] += time.perf_counter() - t0
            sends += [pipe.send_next(h, _tag(i, _ACT)), pipe.send_next(busy, _tag(i, _BUSY))]
            continue
        logits = model.compute_logits(h, b.logits_rows)
        hidden = None if b.pool_rows is None else model.norm(h[b.pool_rows])
        busy[pipe.stage] += time.perf_counter() - t0
        if pipe.sends_output:
            sends.append(pipe.send_to_driver(logits, _tag(i, _LOGITS)))
            if hidden is not None:
                sends.append(pipe.send_to_driver(hidden, _tag(i, _HIDDEN)))
            sends.append(pipe.send_to_driver(busy, _tag(i, _OUT_BUSY)))
    for op in sends:
        op.wait()
    if not pipe.is_driver:
        return [(torch.empty(b.logits_rows.numel(), 0), None) for b in batches]
    return _collect_outputs(outputs, stats, start)


_Posted = tuple[PendingOp, PendingOp | None, PendingOp]


def _post_output_receives(
    model: DecoderForCausalLM, pipe: PipelineGroup, batches: list[MicroBatch]
) -> list[_Posted]:
    """Driver: post, per micro-batch, the receives of the last stage's logits, pooled hidden
    states (when wanted) and busy vector."""
    posted: list[_Posted] = []
    vocab, width = model.config.vocab_size, model.config.hidden_size
    for i, b in enumerate(batches):
        logits = torch.empty(b.logits_rows.numel(), vocab, dtype=torch.float32)
        hidden = None
        if b.pool_rows is not None:
            buf = torch.empty(b.pool_rows.numel(), width, dtype=model.dtype)
            hidden = pipe.recv_from_last(buf, _tag(i, _HIDDEN))
        busy = torch.zeros(pipe.num_stages, dtype=torch.float64)
        posted.append(
            (
                pipe.recv_from_last(logits, _tag(i, _LOGITS)),
                hidden,
                pipe.recv_from_last(busy, _tag(i, _OUT_BUSY)),
            )
        )
    return posted


def _collect_outputs(
    posted: list[_Posted], stats: PipelineStats, start: float
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Driver: wait for every micro-batch's outputs; add the stages' busy times to ``stats``."""
    results: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    total: torch.Tensor | None = None
    for logits, hidden, busy in posted:
        results.append((logits.wait(), None if hidden is None else hidden.wait()))
        total = busy.wait() if total is None else total + busy.wait()
    assert total is not None
    if not stats.busy_s:
        stats.busy_s = [0.0] * total.numel()
    stats.busy_s = [a + float(b) for a, b in zip(stats.busy_s, total.tolist(), strict=True)]
    stats.wall_s += time.perf_counter() - start
    stats.steps += 1
    stats.micro_batches += len(posted)
    return results
