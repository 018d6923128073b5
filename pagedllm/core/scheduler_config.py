"""The scheduler's limits and policy switches (``core.scheduler`` reads them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerConfig:
    """Scheduler limits.

    Attributes:
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: most tokens computed in one step.
        max_model_len: longest sequence (tokens).
        enable_chunked_prefill: allow a prompt to take several steps.
        preemption_mode: "recompute" (free the blocks, recompute later), "swap" (move the blocks
            to host swap space), or "auto": recompute for single-sequence groups (cheap: one
            prefill) and swap for groups of several sequences (parallel samples, beams), whose
            shared blocks a recompute would duplicate. Swap falls back to recompute when the
            swap space is full.
        policy: "fcfs" (arrival order) or "priority" (``(priority, arrival)`` order with
            priority preemption; see the module docstring).
        prefill_first: (fcfs only) when the first ready waiting group can be admitted, the
            step runs only the admissions, not the running groups' decodes: the new request's
            first token does not wait for the batch's decode rows (vLLM V0's order).

    Raises:
        ValueError: naming ``policy``, ``preemption_mode`` or ``prefill_first`` (with the
            priority policy, whose admissions preempt running groups instead).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = False
    preemption_mode: str = "auto"
    policy: str = "fcfs"
    prefill_first: bool = False

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be fcfs or priority, got {self.policy!r}")
        if self.prefill_first and self.policy != "fcfs":
            raise ValueError("prefill_first works with the fcfs scheduling policy only")
        if self.preemption_mode not in ("auto", "swap", "recompute"):
            raise ValueError(
                f"preemption_mode must be auto, swap or recompute, got {self.preemption_mode!r}"
            )
