"""FCFS or priority scheduler with continuous batching and preemption (paper section 4.5).

Every step the scheduler decides which sequences compute how many tokens, in the vocabulary of
``num_computed_tokens``: a sequence with ``k`` tokens not yet in the KV cache gets up to ``k`` of
them this step (all of a prompt, one for a decode, a chunk with chunked prefill). Decisions are
emitted as a plain ``SchedulerOutput``; the scheduler never touches tensors.

Policy:
- Running groups are served oldest first; waiting groups are admitted in arrival order, only when
  their blocks fit and only if no running group had to be preempted this step.
- When a running sequence needs a block and none is free, the most recently arrived running group
  is preempted whole (all-or-nothing) by recompute: its blocks are freed and it goes back to the
  head of the waiting queue, keeping its generated tokens and sampling state.
- A group admitted on its prompt may later need more blocks than the whole pool holds (its
  samples grown apart). When the oldest running group cannot get the blocks of even its
  smallest step (one token of each sequence it schedules; ``core.length_cap``) with every other
  group preempted, it cannot make progress at all: its unfinished sequences are finished by
  length (``SchedulerOutput.length_capped``) instead of preempting it again and again; short of
  that, its chunks are cut to what the pool would hold with it alone (not preempting itself). The
  same holds for a group preempted by recompute that an empty engine still cannot take back
  (its samples outgrew the pool, or their recompute the token budget): it would otherwise
  wait forever, and every group behind it. With a sliding window and chunked prefill only
  its first chunk must fit then (``length_cap.admission_room``).
- A beam search's beams are scheduled together or not at all, and sample in the same step (they
  are ranked together): while one still recomputes its tokens, the others stop short of theirs.
- A group preempted by recompute comes back with its samples sharing the prompt blocks the
  first sample recomputes (paper figure 8); with chunked prefill the others wait, unscheduled,
  until those blocks are written.
- A group counts its eventual sequences (``n`` / ``best_of`` samples or beams) against
  ``max_num_seqs`` when admitted; validation refuses a group wider than ``max_num_seqs``, so a
  swapped-out group always comes back once the running ones drain.

Priority policy (``policy="priority"``, vLLM's ``--scheduling-policy priority``): every queue is
ordered by ``(priority, arrival_index)`` instead of arrival alone (lower priority value = more
urgent; ties by arrival), so "oldest" above reads "most urgent" and the victim is the least
urgent running group. Before the running groups are scheduled, when the most urgent waiting group
cannot be admitted (blocks, ``max_num_seqs`` or the token budget) while a less urgent group runs,
the least urgent running group is preempted whole (swap or recompute as above) until it can
(vLLM's priority preemption). Swapped and waiting groups are then brought in together in that
order, stopping at the first that does not fit (no overtaking). FCFS is the default, and under it
every priority is 0, so both policies share the ordering key.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Callable

from pagedllm.core.kv_manager import KVManager
from pagedllm.core.length_cap import admission_room, fit_plan, free_when_alone
from pagedllm.core.scheduler_config import SchedulerConfig
from pagedllm.core.scheduler_output import ScheduledSequence, SchedulerOutput
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus

logger = logging.getLogger(__name__)

__all__ = ["Scheduler", "SchedulerConfig"]


class Scheduler:
    """Owns the waiting and running queues and the block manager.

    Args:
        config: limits.
        block_manager: the KV manager whose blocks the scheduler hands out (paged or
            contiguous; see ``core.kv_manager.KVManager``).
    """

    def __init__(self, config: SchedulerConfig, block_manager: KVManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[SequenceGroup] = deque()
        # Kept sorted by arrival_index so that "oldest first" and "newest = victim" are O(1).
        self.running: list[SequenceGroup] = []
        # Swapped-out groups, kept in arrival order; resumed before any waiting group.
        self.swapped: list[SequenceGroup] = []
        self.num_preemptions = 0
        self.preemptions_by_mode = {"recompute": 0, "swap": 0}
        self.num_blocks_swapped_out = 0
        self.num_blocks_swapped_in = 0
        self._scheduled_seqs: dict[int, Sequence] = {}
        # seq_id -> (lead, shared blocks): samples of a group readmitted under chunked prefill
        # that wait, unscheduled, until the lead has written the prompt blocks they share.
        self._awaiting_share: dict[int, tuple[Sequence, int]] = {}
        # Whether a waiting group may be admitted now (the engine sets it: structured outputs
        # wait for their grammar); skipped groups keep their place in the queue.
        self.is_ready: Callable[[SequenceGroup], bool] = lambda group: True

    # ---- queue management ----------------------------------------------------------------
    @staticmethod
    def order_key(group: SequenceGroup) -> tuple[int, int]:
        """Scheduling order: ``(priority, arrival_index)``, smaller first (FCFS: priority 0)."""
        return group.priority, group.arrival_index

    def add_seq_group(self, group: SequenceGroup) -> None:
        """Queue a new request: at the back of ``waiting`` (FCFS), or at its place by
        ``order_key`` (priority)."""
        if self.config.policy == "priority":
            bisect.insort(self.waiting, group, key=self.order_key)
        else:
            self.waiting.append(group)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting, running or swapped out."""
        return bool(self.waiting or self.running or self.swapped)

    def num_unfinished(self) -> int:
        """Requests waiting, running or swapped out."""
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Remove a request wherever it is and free its blocks; returns it (or None)."""
        for queue in (self.running, self.swapped, self.waiting):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    for seq in group.seqs:
                        if not seq.is_finished():
                            seq.status = SequenceStatus.FINISHED_ABORTED
                        self.free_seq(seq)
                    return group
        return None

    def free_finished(self) -> list[SequenceGroup]:
        """Drop finished groups from ``running`` and free their blocks; returns them."""
        done = [g for g in self.running if g.is_finished()]
        if done:
            self.running = [g for g in self.running if not g.is_finished()]
            for group in done:
                for seq in group.seqs:
                    self.free_seq(seq)
        return done

    def free_seq(self, seq: Sequence) -> None:
        """Release one sequence's blocks (a finished sample or a pruned beam of a live group)."""
        self._awaiting_share.pop(seq.seq_id, None)
        self.block_manager.free(seq)

    # ---- the step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Choose this step's work. See the module docstring for the policy."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self._scheduled_seqs = {}
        priority = self.config.policy == "priority"
        if priority:
            self._preempt_for_priority(out)
        num_priority_preempted = len(out.preempted)

        # 1. Running groups, oldest first. A victim is always taken from the newest end, which
        #    is never a group already scheduled in this loop.
        idx = len(self.running) if self._admissions_only() else 0
        while idx < len(self.running):
            group = self.running[idx]
            plan = self._group_plan(group, budget)
            if not plan:
                idx += 1
                continue
            need = self._need(plan)
            if need > self.block_manager.num_free_blocks and any(s.spec_token_ids for s, _ in plan):
                # Memory is short: drop the speculative tokens before preempting anyone.
                for seq, _ in plan:
                    seq.spec_token_ids = []
                plan = self._group_plan(group, budget)
                need = self._need(plan)
            # (The pool alone holds at least the free blocks: the count is needed only past them.)
            if idx == 0 and need > self.block_manager.num_free_blocks:
                alone = free_when_alone(self.block_manager, self.running, group)
                if need > alone:
                    # Judged on the group's smallest step, not on the budget's chunks: with a
                    # sliding window a prefix recomputed chunk by chunk fits where one chunk of
                    # it does not (a sample that could not share the lead's blocks, say).
                    plan = self._group_plan(group, budget, max_blocks=alone)
                    if not plan:
                        self._cap_length(group, out)  # not one token each, even alone
                        idx += 1
                        continue
                    need = self._need(plan)
            while need > self.block_manager.num_free_blocks:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is group:
                    break
                need = self._need(plan)  # a victim's shared blocks may spare copy-on-writes
            else:
                budget -= self._commit(group, plan, out)
                idx += 1
                continue
            break  # the group preempted itself: it was the newest, nothing after it remains

        if priority:
            # 2+3. Swapped and waiting groups together, most urgent first, unless memory was
            #    short while scheduling the running groups.
            if len(out.preempted) == num_priority_preempted and not out.length_capped:
                budget = self._admit_by_priority(budget, out)
            out.num_batched_tokens = self.config.max_num_batched_tokens - budget
            return out

        # 2. Swapped groups come back first, oldest first, unless memory was short this step
        #    (a group finished by length gives its blocks back only after the step).
        if not out.preempted and not out.length_capped:
            num_seqs = sum(self._width(g) for g in self.running)
            while self.swapped and self._can_swap_in(self.swapped[0], num_seqs):
                group = self.swapped[0]
                num_seqs += len(group.unfinished_seqs())
                budget -= self._swap_in(group, budget, out)

        # 3. Waiting groups in FCFS order, only when nothing is swapped out or preempted.
        if not out.preempted and not out.length_capped and not self.swapped:
            num_seqs = sum(self._width(g) for g in self.running)
            for group in list(self.waiting):
                if budget <= 0:
                    break
                if not self.is_ready(group):
                    continue  # e.g. its grammar still compiles: the ones behind it may go
                if not self._can_admit(group, budget, num_seqs):
                    self._cap_if_never_admitted(group, out)
                    break
                self.waiting.remove(group)
                num_seqs += self._width(group)
                budget -= self._admit(group, group.unfinished_seqs(), budget, out)

        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def _admissions_only(self) -> bool:
        """``prefill_first``: whether this step should run only admissions (the first ready
        waiting group fits now, nothing is swapped out, and some group runs)."""
        if not (self.config.prefill_first and self.running) or self.swapped:
            return False
        head = self._first_ready_waiting()
        num_seqs = sum(self._width(g) for g in self.running)
        budget = self.config.max_num_batched_tokens
        return head is not None and self._can_admit(head, budget, num_seqs)

    def _can_admit(self, group: SequenceGroup, budget: int, num_seqs: int) -> bool:
        """Whether waiting ``group`` fits now: ``max_num_seqs``, the token budget (whole
        prompts without chunked prefill) and its blocks (``admission_room``)."""
        seqs = group.unfinished_seqs()
        if num_seqs + self._width(group) > self.config.max_num_seqs:
            return False
        if not self.config.enable_chunked_prefill and self._prefill_tokens(seqs) > budget:
            return False
        return self._first_step_room(seqs) != 0

    def _first_step_room(self, seqs: list[Sequence]) -> int | None:
        """``admission_room`` of waiting ``seqs``: alone when nothing runs or is swapped out."""
        alone = self.config.enable_chunked_prefill and not (self.running or self.swapped)
        return admission_room(self.block_manager, seqs, bool(self.running), chunk_alone=alone)

    def _can_swap_in(self, group: SequenceGroup, num_seqs: int) -> bool:
        """Whether swapped-out ``group`` fits now (``max_num_seqs`` and its blocks)."""
        seqs = group.unfinished_seqs()
        if num_seqs + len(seqs) > self.config.max_num_seqs:
            return False
        return self.block_manager.can_swap_in(seqs, reserve=bool(self.running))

    def _swap_in(self, group: SequenceGroup, budget: int, out: SchedulerOutput) -> int:
        """Move a swapped-out group back to running and schedule its work if it fits; returns
        the tokens scheduled."""
        self.swapped.remove(group)
        seqs = group.unfinished_seqs()
        moved = self.block_manager.swap_in(seqs)
        out.blocks_to_swap_in.extend(moved)
        self.num_blocks_swapped_in += len(moved)
        for seq in seqs:
            seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, group, key=self.order_key)
        plan = self._group_plan(group, budget)
        if plan and self._fits(plan):
            return self._commit(group, plan, out)
        return 0

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """Priority policy, before the running groups are scheduled: while the most urgent
        waiting group cannot be admitted and a less urgent group runs, preempt the least urgent
        running group whole (vLLM's priority preemption). The token budget counts the running
        groups' pending tokens (one per decode)."""
        head = self._first_ready_waiting()
        if head is None:
            return
        key = self.order_key(head)
        while self.running and self.order_key(self.running[-1]) > key:
            pending = sum(
                s.num_uncomputed_tokens for g in self.running for s in g.unfinished_seqs()
            )
            num_seqs = sum(self._width(g) for g in self.running)
            budget = self.config.max_num_batched_tokens - pending
            if self._can_admit(head, budget, num_seqs):
                return
            self._preempt(self.running[-1], out)

    def _admit_by_priority(self, budget: int, out: SchedulerOutput) -> int:
        """Priority policy: bring in swapped and waiting groups in ``order_key`` order while
        they fit, stopping at the first that does not (or at a group preempted this step);
        returns the budget left."""
        num_seqs = sum(self._width(g) for g in self.running)
        preempted = set(out.preempted)
        while budget > 0:
            ready = self._first_ready_waiting()
            cands = [g for g in (self.swapped[0] if self.swapped else None, ready) if g]
            if not cands:
                break
            group = min(cands, key=self.order_key)
            if group.request_id in preempted:
                break
            if self.swapped and group is self.swapped[0]:
                if not self._can_swap_in(group, num_seqs):
                    break
                num_seqs += len(group.unfinished_seqs())
                budget -= self._swap_in(group, budget, out)
            else:
                if not self._can_admit(group, budget, num_seqs):
                    self._cap_if_never_admitted(group, out)
                    break
                self.waiting.remove(group)
                num_seqs += self._width(group)
                budget -= self._admit(group, group.unfinished_seqs(), budget, out)
        return budget

    def _first_ready_waiting(self) -> SequenceGroup | None:
        """The first waiting group (queue order) that ``is_ready`` admits now, or None."""
        return next((g for g in self.waiting if self.is_ready(g)), None)

    @staticmethod
    def _width(group: SequenceGroup) -> int:
        """Sequences the group runs: its unfinished ones, or all its samples / beams while it
        is one sequence that has not sampled yet (it forks at its first sample)."""
        seqs = group.unfinished_seqs()
        if len(group.seqs) == 1 and group.seqs[0].num_output_tokens == 0:
            params = group.sampling_params
            return max(len(seqs), params.n, params.best_of or 1)
        return len(seqs)

    def _cap_if_never_admitted(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """A waiting group preempted by recompute that does not fit even with nothing running,
        swapped or scheduled (its samples grew past the pool, or their recompute past
        ``max_num_batched_tokens``) would wait forever, and every group behind it: it is
        finished by length instead, as a running group that cannot grow alone is."""
        if self.running or self.swapped or out.scheduled:
            return
        if not any(s.num_output_tokens for s in group.unfinished_seqs()):
            return  # a new request: check_request_fits guaranteed its admission
        if self._width(group) > self.config.max_num_seqs:
            return
        self.waiting.remove(group)
        bisect.insort(self.running, group, key=self.order_key)
        self._cap_length(group, out)

    def _cap_length(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Finish a running group that cannot get its next blocks even alone in the pool: its
        unfinished sequences end by length (logged); it stays in ``running`` until
        ``free_finished``."""
        seqs = group.unfinished_seqs()
        logger.warning(
            "request %s finished by length: its %d sequence(s) need %d more KV blocks, more than "
            "the pool (%d blocks of %d tokens) would have free with every other request preempted",
            group.request_id,
            len(seqs),
            self._need([(s, s.num_uncomputed_tokens) for s in seqs]),
            self.block_manager.num_blocks,
            self.block_manager.block_size,
        )
        for seq in seqs:
            seq.status = SequenceStatus.FINISHED_LENGTH
        out.length_capped.append(group.request_id)

    def _prefill_tokens(self, seqs: list[Sequence]) -> int:
        """Tokens a waiting group computes when admitted (after cache hits and group sharing)."""
        bm = self.block_manager
        shared = bm.group_shared_blocks(seqs)
        total = 0
        for i, s in enumerate(seqs):
            have = len(bm.cached_prefix_blocks(s))
            total += s.num_tokens - bm.block_size * (have if i == 0 else max(have, shared))
        return total

    def _admit(
        self, group: SequenceGroup, seqs: list[Sequence], budget: int, out: SchedulerOutput
    ) -> int:
        """Move a waiting group to running: prefix-cache hits first, then this step's work.
        Returns the tokens scheduled."""
        bm = self.block_manager
        shared = bm.group_shared_blocks(seqs)
        room = self._first_step_room(seqs)  # before the lead's cached prefix takes its blocks
        lead, others = seqs[0], seqs[1:]
        lead.num_computed_tokens = bm.allocate_prefix(lead)
        followers = []
        for seq in others:
            if room is None and len(bm.cached_prefix_blocks(seq)) >= shared:
                seq.num_computed_tokens = bm.allocate_prefix(seq)
            else:
                followers.append(seq)
        for seq in seqs:
            seq.status = SequenceStatus.RUNNING
        if group.metrics.first_scheduled_time is None:
            group.num_cached_tokens = sum(s.num_computed_tokens for s in seqs)
        bisect.insort(self.running, group, key=self.order_key)
        lead_plan = self._plan([lead], budget)
        if room is not None:  # only the lead's first chunk fits: cut to it, the others wait
            lead_plan = fit_plan(bm, lead_plan, room)
        # Beams sample together: unless every sequence finishes its recompute in this step,
        # none reaches its sampling token yet.
        hold = False
        if group.beam is not None and others:
            waiting_to_share = {s.seq_id for s in followers}
            rest_tokens = sum(
                s.num_tokens - shared * bm.block_size
                if s.seq_id in waiting_to_share
                else s.num_uncomputed_tokens
                for s in others
            )
            lead_tokens = lead_plan[0][1] if lead_plan else 0
            hold = room is not None or lead_tokens < lead.num_uncomputed_tokens  # (others wait)
            hold = hold or lead_tokens + rest_tokens > budget
        used = self._commit(group, self._hold_samples(lead_plan) if hold else lead_plan, out)
        for seq in followers:
            if room is None and lead.num_computed_tokens + used >= shared * bm.block_size:
                # The lead writes the shared prompt blocks in this very step; the followers'
                # attention reads them after the write (K/V are stored before attention per
                # layer).
                seq.num_computed_tokens = bm.share_prefix(lead, seq, shared)
            else:
                # The lead's first chunk stops short of them (chunked prefill) or alone fits:
                # wait for it rather than recompute the prompt into blocks of their own.
                self._awaiting_share[seq.seq_id] = (lead, shared)
        if room is not None:
            return used
        rest = [s for s in self._schedulable(group) if s is not lead]
        plan = self._plan(rest, budget - used, together=group.beam is not None)
        return used + self._commit(group, self._hold_samples(plan) if hold else plan, out)

    def _group_plan(
        self, group: SequenceGroup, budget: int, max_blocks: int | None = None
    ) -> list[tuple[Sequence, int]]:
        """This step's plan for running ``group`` (``_plan`` over its ``_schedulable``
        sequences), its chunks cut to ``max_blocks`` new blocks when given (``fit_plan``; []
        when one token each does not fit). A beam search's beams are ranked together, so they
        sample in the same step or none does: while some beam still recomputes (or waits to
        share, or had its chunk cut), the others stop one token short of their sampling token."""
        plan = self._plan(self._schedulable(group), budget, together=group.beam is not None)
        if max_blocks is not None:
            plan = fit_plan(self.block_manager, plan, max_blocks)
        if group.beam is None:
            return plan
        every_beam_samples = len(plan) == len(group.unfinished_seqs()) and all(
            n >= seq.num_uncomputed_tokens for seq, n in plan
        )
        return plan if every_beam_samples else self._hold_samples(plan)

    @staticmethod
    def _hold_samples(plan: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """``plan`` with each sequence that would reach its sampling token (all its tokens
        computed) one token short of it; those left with nothing to compute drop out."""
        held = [(seq, n - (n >= seq.num_uncomputed_tokens)) for seq, n in plan]
        return [(seq, n) for seq, n in held if n > 0]

    def _schedulable(self, group: SequenceGroup) -> list[Sequence]:
        """The group's unfinished sequences that may compute this step: a sample waiting for
        its lead's recomputed prompt blocks (``_admit``) joins once the lead has written them,
        sharing them (or taking its own prefix, when the lead's sliding window has already let
        some of them go)."""
        seqs = group.unfinished_seqs()
        if not self._awaiting_share:
            return seqs
        bm = self.block_manager
        ready = []
        for seq in seqs:
            entry = self._awaiting_share.get(seq.seq_id)
            if entry is None:
                ready.append(seq)
                continue
            lead, shared = entry
            if lead.num_computed_tokens < shared * bm.block_size and not lead.is_finished():
                continue
            del self._awaiting_share[seq.seq_id]
            if bm.can_share_prefix(lead, shared):
                seq.num_computed_tokens = bm.share_prefix(lead, seq, shared)
            else:
                seq.num_computed_tokens = bm.allocate_prefix(seq)
            ready.append(seq)
        return ready

    def on_step_done(self, out: SchedulerOutput) -> None:
        """After the forward pass: advance ``num_computed_tokens`` of every scheduled sequence and
        register its newly full blocks in the prefix cache (for a sequence that verified
        speculative tokens, only after its rejected tokens are rolled back:
        ``finish_speculation``)."""
        for _, work in out.scheduled:
            seq = self._scheduled_seqs[work.seq_id]
            seq.num_computed_tokens += len(work.token_ids)
            if not work.num_spec_tokens:
                self.block_manager.mark_computed(seq)

    def finish_speculation(self, seq: Sequence, num_rejected: int) -> None:
        """After verification: give back the slots of ``seq``'s ``num_rejected`` last computed
        tokens (``KVManager.rollback_slots``), then register its full blocks, all accepted."""
        self.block_manager.rollback_slots(seq, num_rejected)
        self.block_manager.mark_computed(seq)

    def _plan(
        self, seqs: list[Sequence], budget: int, together: bool = False
    ) -> list[tuple[Sequence, int]]:
        """Tokens each sequence computes this step, within the budget ([] = none fit).
        ``together``: every sequence with work gets some or none does (a beam search's beams
        are ranked together every step); under chunked prefill they share the budget evenly."""
        plan = []
        # Together, the budget is shared evenly (the rest to the later ones): the first
        # sequences taking it all left the last none, so the group never ran.
        with_work = sum(1 for s in seqs if s.num_uncomputed_tokens) if together else 0
        for seq in seqs:
            n = seq.num_uncomputed_tokens
            if self.config.enable_chunked_prefill:
                share = budget
                if together and n:
                    share, with_work = budget // with_work, with_work - 1
                n = min(n, share)
                if together and n == 0 < seq.num_uncomputed_tokens:
                    return []
            if n > budget:
                return []  # without chunking a group's work fits whole or waits
            if n == 1 == seq.num_uncomputed_tokens:
                n += min(len(seq.spec_token_ids), budget - 1)  # a decode verifies its proposals
            if n:
                plan.append((seq, n))
                budget -= n
        return plan

    def _need(self, plan: list[tuple[Sequence, int]]) -> int:
        """New blocks ``plan`` takes (copy-on-writes included)."""
        return self.block_manager.num_blocks_needed(plan)

    def _fits(self, plan: list[tuple[Sequence, int]]) -> bool:
        return self._need(plan) <= self.block_manager.num_free_blocks

    def _commit(
        self, group: SequenceGroup, plan: list[tuple[Sequence, int]], out: SchedulerOutput
    ) -> int:
        """Allocate the slots of ``plan`` and add it to ``out``; returns the tokens used."""
        want_prompt_logprobs = group.sampling_params.prompt_logprobs is not None
        pool = group.sampling_params.pooling is not None
        used = 0
        for seq, n in plan:
            out.blocks_to_copy.extend(self.block_manager.allocate_slots(seq, n))
            start = seq.num_computed_tokens
            end = start + n
            num_spec = max(0, end - seq.num_tokens)
            spec, seq.spec_token_ids = seq.spec_token_ids[:num_spec], []
            self._scheduled_seqs[seq.seq_id] = seq
            out.scheduled.append(
                (
                    group.request_id,
                    ScheduledSequence(
                        seq_id=seq.seq_id,
                        token_ids=seq.token_ids[start:end] + spec,
                        start_pos=start,
                        block_table=self.block_manager.get_block_table(seq),
                        do_sample=end >= seq.num_tokens and not pool,
                        prompt_logprobs=want_prompt_logprobs and start < seq.num_prompt_tokens,
                        pool=pool,
                        num_spec_tokens=num_spec,
                        num_prompt_tokens=seq.num_prompt_tokens,
                    ),
                )
            )
            used += n
        return used

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Preempt a running group whole, by swap or by recompute (see ``preemption_mode``)."""
        self.running.remove(group)
        seqs = group.unfinished_seqs()
        mode = self.config.preemption_mode
        if mode == "auto":
            mode = "swap" if len(group.seqs) > 1 else "recompute"
        if mode == "swap" and self.block_manager.can_swap_out(seqs):
            moved = self.block_manager.swap_out(seqs)
            out.blocks_to_swap_out.extend(moved)
            self.num_blocks_swapped_out += len(moved)
            for seq in seqs:
                seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, group, key=self.order_key)
            self.preemptions_by_mode["swap"] += 1
        else:
            # Recompute: free the blocks, requeue at the head; tokens and sampling state stay.
            for seq in seqs:
                self.free_seq(seq)
                seq.reset_for_recompute()
            if self.config.policy == "priority":
                bisect.insort(self.waiting, group, key=self.order_key)
            else:
                self.waiting.appendleft(group)
            self.preemptions_by_mode["recompute"] += 1
        group.metrics.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(group.request_id)
