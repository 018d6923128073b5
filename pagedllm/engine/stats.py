"""Engine counters and the paper-figure accounting of the KV memory.

``EngineStats`` holds everything. The engine core keeps its cheap counters (steps, tokens,
preemptions, peak blocks) up to date on every step. The per-step walk over the block tables that
the paper's figures need (figure 2 memory waste, figure 13 batched requests, figure 15 sharing
saving, slot utilization) is ``KVStatsObserver``: the engine calls it after a step only while it
is enabled (``LLMEngine.enable_kv_stats``), so a serving engine that prints none of these pays
nothing for them.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from pagedllm.core.kv_manager import FREED_BLOCK, KVManager
from pagedllm.core.kv_waste import KVWaste
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    from pagedllm.engine.kv_snapshot import EngineCounters

# The periodic throughput line is the async engine's log (its logger name, as before the move).
logger = logging.getLogger("pagedllm.engine.async_engine")


@dataclass
class EngineStats:
    """Counters over the engine's life.

    Always counted:
        num_steps: steps that ran the model.
        prompt_tokens / generation_tokens: tokens computed for prompts / sampled.
        peak_blocks_used: most KV blocks in use after any step.
        num_preemptions: preemptions of running requests (swap or recompute).
        num_interrupted_steps: steps stopped between layers and discarded to take a new
            request in (``interrupt_decode_for_prefill``, ``model.step_interrupt``).
        spec_num_drafts / spec_draft_tokens / spec_accepted_tokens: speculative decoding
            (``spec_decode``): verifications of a sequence's proposals, tokens proposed, tokens
            accepted; ``spec_accepted_per_pos[j]`` / ``spec_draft_per_pos[j]``: accepted /
            proposed tokens at draft position ``j`` (0-based), so their ratio is the
            acceptance rate per position.

    Counted only on the steps the ``KVStatsObserver`` watched (``observed_steps`` of them):
        slot_utilization_sum: sum over steps of (tokens held in the cache / slots of the blocks
            in use); divide by ``observed_steps`` for the mean share of allocated KV slots that
            hold real token states (the paper's figure 2 metric for a paged cache).
        blocks_used_sum / blocks_unshared_sum: sums over steps of the blocks in use, and of the
            blocks the same sequences would use if nothing were shared (the sum of their block
            table lengths): the paper's figure 15 memory saving is 1 - used / unshared.
        batched_requests_sum: sum over steps of the requests scheduled in the step; divide by
            ``observed_steps`` for the paper's figure 13 (average number of batched requests).
        kv_token_states_share_sum / kv_reserved_share_sum / kv_internal_fragmentation_share_sum
            / kv_external_fragmentation_share_sum: sums over steps of each part's share of the
            accounted KV memory (paper figure 2; definitions in ``core.kv_waste``);
            ``kv_waste_steps`` counts the steps with allocated memory. The mean is weighted by
            step (every step counts once, however long it took).
    """

    num_steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    peak_blocks_used: int = 0
    slot_utilization_sum: float = 0.0
    num_preemptions: int = 0
    num_interrupted_steps: int = 0
    blocks_used_sum: int = 0
    blocks_unshared_sum: int = 0
    batched_requests_sum: int = 0
    kv_token_states_share_sum: float = 0.0
    kv_reserved_share_sum: float = 0.0
    kv_internal_fragmentation_share_sum: float = 0.0
    kv_external_fragmentation_share_sum: float = 0.0
    kv_waste_steps: int = 0
    observed_steps: int = 0
    spec_num_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    spec_draft_per_pos: list[int] = field(default_factory=list)

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / proposed speculative tokens (0 when none was proposed)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens emitted per verification: accepted drafts + the one target token (0 if none)."""
        if not self.spec_num_drafts:
            return 0.0
        return 1.0 + self.spec_accepted_tokens / self.spec_num_drafts

    @property
    def spec_acceptance_per_pos(self) -> list[float]:
        """Accepted / proposed speculative tokens at each draft position (0 where none)."""
        return [
            a / d if d else 0.0
            for a, d in zip(self.spec_accepted_per_pos, self.spec_draft_per_pos, strict=False)
        ]

    def spec_decode_line(self) -> str | None:
        """The speculative decoding figures as one line (acceptance, mean accepted length,
        per-position acceptance), or None when nothing was proposed."""
        if not self.spec_draft_tokens:
            return None
        per_pos = ", ".join(f"{r:.2f}" for r in self.spec_acceptance_per_pos)
        return (
            f"speculative decoding: acceptance {100 * self.spec_acceptance_rate:.1f}% "
            f"({self.spec_accepted_tokens} of {self.spec_draft_tokens} draft tokens), mean "
            f"accepted length {self.spec_mean_accepted_length:.2f}, per position [{per_pos}]"
        )

    @property
    def mean_batched_requests(self) -> float:
        """Requests per step, averaged over the observed steps (paper figure 13; 0 if none)."""
        return self.batched_requests_sum / self.observed_steps if self.observed_steps else 0.0

    def memory_waste(self) -> dict[str, float]:
        """Mean share (0..1, step-weighted) of the accounted KV memory holding token states,
        reserved for future tokens, lost to internal and to external fragmentation."""
        n = self.kv_waste_steps or 1
        return {
            "token_states": self.kv_token_states_share_sum / n,
            "reserved": self.kv_reserved_share_sum / n,
            "internal_fragmentation": self.kv_internal_fragmentation_share_sum / n,
            "external_fragmentation": self.kv_external_fragmentation_share_sum / n,
        }

    def summary(self) -> dict[str, Any]:
        """Every counter plus the derived figures (batched requests, memory waste, slot
        utilization, sharing saving, speculative acceptance), JSON-ready."""
        return {
            **asdict(self),
            "mean_batched_requests": self.mean_batched_requests,
            "mean_slot_utilization": self.mean_slot_utilization,
            "sharing_saving": self.sharing_saving,
            "memory_waste": self.memory_waste(),
            "spec_acceptance_rate": self.spec_acceptance_rate,
            "spec_mean_accepted_length": self.spec_mean_accepted_length,
            "spec_acceptance_per_pos": self.spec_acceptance_per_pos,
        }

    @classmethod
    def from_summary(cls, summary: dict[str, Any]) -> EngineStats:
        """The counters of a ``summary()`` dict (its derived figures are recomputed)."""
        return cls(**{f.name: summary[f.name] for f in fields(cls)})

    @classmethod
    def delta(cls, before: dict[str, Any], after: dict[str, Any]) -> EngineStats:
        """The counters of the steps between two ``summary()`` dicts (``peak_blocks_used`` is
        the later value: a peak cannot be differenced)."""
        kw = {f.name: _minus(after[f.name], before[f.name]) for f in fields(cls)}
        kw["peak_blocks_used"] = after["peak_blocks_used"]
        return cls(**kw)

    def add_waste(self, w: KVWaste) -> None:
        """Add one step's breakdown (steps with no accounted memory are skipped)."""
        if w.total <= 0:
            return
        self.kv_waste_steps += 1
        self.kv_token_states_share_sum += w.token_states / w.total
        self.kv_reserved_share_sum += w.reserved / w.total
        self.kv_internal_fragmentation_share_sum += w.internal_fragmentation / w.total
        self.kv_external_fragmentation_share_sum += w.external_fragmentation / w.total

    @property
    def mean_slot_utilization(self) -> float:
        """Share (0..1) of the slots of the blocks in use holding token states, averaged over
        the observed steps (0 if none)."""
        return self.slot_utilization_sum / self.observed_steps if self.observed_steps else 0.0

    @property
    def sharing_saving(self) -> float:
        """Share of KV blocks saved by sharing, averaged over steps (0 when nothing shared)."""
        if not self.blocks_unshared_sum:
            return 0.0
        return 1.0 - self.blocks_used_sum / self.blocks_unshared_sum


class KVStatsObserver:
    """Adds one step's paper-figure accounting to ``EngineStats`` (figures 2, 13 and 15).

    Costs a walk over every block table per step (``KVManager.waste``), so the engine calls it
    only while enabled.

    Args:
        stats: the counters to add to.
    """

    def __init__(self, stats: EngineStats) -> None:
        self.stats = stats

    def after_step(self, kv: KVManager, scheduler: Scheduler, sched: SchedulerOutput) -> None:
        """Account the step that ``sched`` described, after its tokens were processed and before
        the finished requests give their blocks back (they still hold them here)."""
        st = self.stats
        used = kv.num_used_blocks
        st.observed_steps += 1
        st.blocks_used_sum += used
        # FREED_BLOCK (-1) entries of windowed sequences hold no block.
        st.blocks_unshared_sum += sum(len(t) - t.count(FREED_BLOCK) for t in kv.block_tables.values())
        st.batched_requests_sum += len({rid for rid, _ in sched.scheduled})
        holders = [s for g in scheduler.running for s in g.seqs]
        head = scheduler.waiting[0].seqs[0] if scheduler.waiting else None
        waste = kv.waste(holders, head)
        st.add_waste(waste)
        if used:
            # Token states count shared blocks once (the waste breakdown's own walk over the
            # block tables, so the tables are walked once per step).
            st.slot_utilization_sum += waste.token_states / (used * kv.block_size)


def _minus(after: Any, before: Any) -> Any:
    """``after - before`` for a counter, element by element for a per-position list."""
    if isinstance(after, list):
        return [a - (before[i] if i < len(before) else 0) for i, a in enumerate(after)]
    return after - before


def log_throughput(c: EngineCounters, dt: float, last_prompt: int, last_gen: int) -> None:
    """Log one throughput line from published counters ``c`` (``dt`` seconds since the line
    with ``last_prompt`` / ``last_gen`` tokens; the server's periodic log)."""
    st = c.stats
    logger.info(
        "prompt throughput: %.1f tokens/s, generation throughput: %.1f tokens/s, "
        "running: %d, waiting: %d, KV cache usage: %.1f%%, preemptions: %d",
        (st.prompt_tokens - last_prompt) / dt,
        (st.generation_tokens - last_gen) / dt,
        c.num_running,
        c.num_waiting,
        100.0 * c.kv_usage,
        st.num_preemptions,
    )
    spec = st.spec_decode_line()
    if spec is not None:
        logger.info("%s", spec)
