"""One pipeline stage's share of a step: receive the activations, run this stage's layers, pass
them on; the last stage computes the logits and sends them to the driver.

There is no separate residual tensor to move: pagedllm's decoder layers carry the residual stream
as their output ``h`` [T, H] (model dtype), so one tensor per step crosses each stage boundary.
Every rank knows T (and the number of logits rows) from the same ``SchedulerOutput``, so the
receiving side allocates the buffer without a shape message.

Idle share: each stage adds its own compute seconds to a small float64 vector [pp] that travels
with the activations and comes back to the driver with the logits; the driver adds its
wall-clock time per step (``PipelineStats``), so ``1 - busy / wall`` is each stage's idle share.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pagedllm.attention import AttentionMetadata
from pagedllm.distributed import PipelineGroup
from pagedllm.model.decoder import DecoderForCausalLM, KVCaches


@dataclass
class PipelineStats:
    """Driver-side totals over all steps.

    Attributes:
        busy_s: per stage, seconds spent computing (its layers, plus the LM head on the last).
        wall_s: seconds from the driver starting a step's forward to receiving its logits.
        steps: steps counted.
    """

    busy_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    steps: int = 0

    def idle_share(self) -> list[float]:
        """Per stage, the share of the pipeline's wall time it was not computing (0 .. 1)."""
        if self.wall_s <= 0:
            return [0.0 for _ in self.busy_s]
        return [max(0.0, 1.0 - b / self.wall_s) for b in self.busy_s]


def run_stage(
    model: DecoderForCausalLM,
    pipe: PipelineGroup,
    kv: KVCaches,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    logits_rows: torch.Tensor,
    pool_rows: torch.Tensor | None,
    stats: PipelineStats,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run this rank's stage of one step.

    Args:
        input_ids, positions: [T] int64 (read by the first stage only).
        kv: this stage's per-layer caches.
        logits_rows: [S] int64 rows whose logits are wanted; pool_rows: [P] int64 rows whose
            final hidden states are wanted (pooling), or None.
        stats: the driver's totals (updated on the driver only).

    Returns:
        (logits [S, V] float32, hidden [P, H] model dtype or None) on the driver; on the other
        ranks an empty [S, 0] tensor and None.
    """
    start = time.perf_counter()
    num_tokens, width = input_ids.numel(), model.config.hidden_size
    busy = torch.zeros(pipe.num_stages, dtype=torch.float64)
    h_in = None
    if not pipe.is_first:
        h_in = pipe.recv_prev(torch.empty(num_tokens, width, dtype=model.dtype))
        pipe.recv_prev(busy)
    t0 = time.perf_counter()
    h = model.run_layers(input_ids, positions, kv, meta, h=h_in)
    empty = torch.empty(logits_rows.numel(), 0, dtype=torch.float32)
    if not pipe.is_last:
        busy[pipe.stage] += time.perf_counter() - t0
        pipe.send_next(h)
        pipe.send_next(busy)
        if not pipe.is_driver:
            return empty, None
        return _receive_output(model, pipe, logits_rows, pool_rows, stats, start)
    logits = model.compute_logits(h, logits_rows)
    hidden = None
    if pool_rows is not None:
        with torch.inference_mode():
            hidden = model.norm(h[pool_rows])
    busy[pipe.stage] += time.perf_counter() - t0
    if pipe.sends_output and not pipe.is_driver:
        pipe.send_to_driver(logits)
        if hidden is not None:
            pipe.send_to_driver(hidden)
        pipe.send_to_driver(busy)
    return (logits, hidden) if pipe.is_driver else (empty, None)


def _receive_output(
    model: DecoderForCausalLM,
    pipe: PipelineGroup,
    logits_rows: torch.Tensor,
    pool_rows: torch.Tensor | None,
    stats: PipelineStats,
    start: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Driver: the last stage's logits (and pooled hidden states) and the stages' busy times."""
    logits = pipe.recv_from_last(
        torch.empty(logits_rows.numel(), model.config.vocab_size, dtype=torch.float32)
    )
    hidden = None
    if pool_rows is not None:
        hidden = pipe.recv_from_last(
            torch.empty(pool_rows.numel(), model.config.hidden_size, dtype=model.dtype)
        )
    busy = pipe.recv_from_last(torch.zeros(pipe.num_stages, dtype=torch.float64))
    if not stats.busy_s:
        stats.busy_s = [0.0] * pipe.num_stages
    stats.busy_s = [a + float(b) for a, b in zip(stats.busy_s, busy.tolist(), strict=True)]
    stats.wall_s += time.perf_counter() - start
    stats.steps += 1
    return logits, hidden
