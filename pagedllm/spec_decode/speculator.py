"""The engine side of speculative decoding: propose before a step, verify after it.

One step with speculation (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", section 2; the deterministic-proposal case of their algorithm 1):

1. ``propose``: for every running, decoding sequence the proposer guesses up to ``k`` next tokens
   (``Sequence.spec_token_ids``); the scheduler then gives the sequence ``k + 1`` slots and the
   model scores ``[last token, d_1 .. d_k]`` in the same forward pass as every other sequence.
2. ``verify``: row ``j`` of the sequence's ``k + 1`` logits rows is sampled by the ordinary
   sampler *as if* ``d_1 .. d_j`` had been generated (same penalties, ``min_tokens`` masks,
   seed counters). Draft ``d_{j+1}`` is accepted while it equals the row-``j`` sample; the first
   sample that differs (or the sample after the last draft, the bonus token) is emitted too.

Why this is exact: each emitted token is the sampler's draw at its own position given exactly
the prefix the sequence really has, i.e. what the non-speculative engine draws there. For a
greedy request that is the argmax (identical output); for a seeded sampled request the
counter-based uniforms depend only on ``(seed, position)``, so its output is identical too. For
a proposal that is a single token (one-hot draft distribution q), "accept ``d`` iff the target
sample equals ``d``" is the rejection rule with acceptance ``min(1, p(d) / q(d)) = p(d)`` and,
on rejection, a draw from ``norm(max(0, p - q))`` = p without ``d``.

3. The KV of the rejected drafts is rolled back (``Scheduler.finish_speculation``), and only
   then are the sequence's full blocks registered in the prefix cache.

Policy: model-free proposers (n-gram, suffix) propose up to ``k`` tokens per sequence and the
step keeps the drafts worth their verification rows (``spec_decode.policy.DraftAllocator``: an
acceptance estimate per draft, learned by the length of the match the proposal continues, and a
goodput rule over the batch's rows); with a draft model
each sequence's ``k`` grows by one after a fully accepted run and halves after a run with no
accepted draft (at least 1). Nobody speculates in a step with ``disable_by_batch_size`` or more
decoding sequences, nor do beam-search or pooling requests.

Structured outputs: a proposal is cut at the first token the request's grammar rejects, and row
``j`` is sampled under the grammar's mask after ``d_1 .. d_j`` (``StructuredOutputManager.
valid_draft_length`` / ``fill_draft_bitmask``), so the emitted tokens are again exactly what the
speculation-off engine samples.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from pagedllm.sampling.by_request import sample_by_request
from pagedllm.sampling.sampler import Sampler, SamplerOutput, SamplingBatch
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.draft_verify import verify_with_draft_probs
from pagedllm.spec_decode.policy import DraftAllocator
from pagedllm.spec_decode.proposer import Proposer, make_proposer

if TYPE_CHECKING:
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.core.scheduler_output import SchedulerOutput
    from pagedllm.engine.output_processor import OutputProcessor
    from pagedllm.engine.stats import EngineStats
    from pagedllm.sequence import Sequence, SequenceGroup
    from pagedllm.structured.manager import StructuredOutputManager


def select_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The rows ``rows`` of ``logits`` ([S, V] float32) as [len(rows), V]: a view when they are
    consecutive (as when every sequence of the step speculates), else a gathered copy. The
    sampler never modifies its logits, so a view is safe; the gather of a batch-1 k = 8
    verification (9 x 49,152 floats) cost ~0.13 ms a step on Zen 4."""
    if not rows:
        return logits[:0]
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return logits[rows[0] : rows[0] + len(rows)]
    return logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]


class Speculator:
    """Proposes speculative tokens before a step and verifies them after it.

    Args:
        config: the engine's speculative config.
        max_model_len: longest sequence (no position past it is ever proposed).
        proposer: the proposer; default ``make_proposer(config)``.

    Attributes:
        structured: the engine's grammar manager (set by ``EngineCore``), which checks and masks
            the proposals of structured-output requests; None = no request is constrained.
    """

    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer | None = None
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = proposer if proposer is not None else make_proposer(config)
        self._k: dict[int, int] = {}  # seq_id -> current adaptive k (draft model)
        # Model-free proposals are cheap to make: propose k, keep what pays for its row.
        self.allocator: DraftAllocator | None = (
            None
            if hasattr(self.proposer, "after_schedule")
            else DraftAllocator(
                knee_rows=config.step_rows_knee,
                row_cost=config.step_row_cost,
                learn_step_cost=config.learn_step_cost,
            )
        )
        self.structured: StructuredOutputManager | None = None

    # ---- before the step ---------------------------------------------------------------------
    def wanted_k(self, group: SequenceGroup) -> int:
        """The most tokens ``group`` may speculate (0: never): its ``num_speculative_tokens``,
        else the engine's; 0 for beam search and pooling, and for structured outputs when the
        proposer drafts only after scheduling (a draft model: its proposals do not exist yet when
        ``propose`` checks them against the grammar)."""
        params = group.sampling_params
        if group.beam is not None:
            return 0
        if params.structured_outputs is not None and hasattr(self.proposer, "after_schedule"):
            return 0
        if params.pooling is not None:
            return 0
        k = params.num_speculative_tokens
        return self.config.num_speculative_tokens if k is None else k

    def propose(self, running: Iterable[SequenceGroup]) -> int:
        """Set ``spec_token_ids`` of every decoding sequence of the ``running`` groups (cleared
        for the others, and for all when the batch is too large). Returns the tokens proposed."""
        groups = list(running)
        decoding = [
            (seq, group)
            for group in groups
            for seq in group.unfinished_seqs()
            if seq.num_uncomputed_tokens == 1 and seq.num_output_tokens > 0
        ]
        for group in groups:
            for seq in group.seqs:
                seq.spec_token_ids = []
        if len(decoding) >= self.config.disable_by_batch_size:
            return 0
        proposed: dict[int, Sequence] = {}
        match_lengths: dict[int, int] = {}  # from a proposer that reports them
        propose_matched = getattr(self.proposer, "propose_matched", None)
        for seq, group in decoding:
            k_max = self.wanted_k(group)
            if k_max <= 0:
                continue
            k = k_max if self.allocator else min(self._k.get(seq.seq_id, k_max), k_max)
            # Never past max_tokens (k + 1 tokens may come out) nor max_model_len (positions).
            if seq.max_num_tokens is not None:
                k = min(k, seq.max_num_tokens - seq.num_tokens - 1)
            k = min(k, self.max_model_len - seq.num_tokens)
            if k <= 0:
                continue
            if propose_matched is not None:
                draft, match_lengths[seq.seq_id] = propose_matched(
                    seq.token_ids, seq.num_prompt_tokens, k, group.request_id
                )
            else:
                draft = self.proposer.propose(
                    seq.token_ids, seq.num_prompt_tokens, k, group.request_id
                )
            draft = draft[:k]
            if self.structured is not None:  # cut at the first token the grammar rejects
                draft = draft[: self.structured.valid_draft_length(seq, group, draft)]
            seq.spec_token_ids = draft
            proposed[seq.seq_id] = seq
        if self.allocator is not None and proposed:
            kept = self.allocator.allocate(
                {sid: len(s.spec_token_ids) for sid, s in proposed.items()},
                len(decoding),
                match_lengths,  # the same keys as `proposed` when the proposer reports them
            )
            for sid, seq in proposed.items():
                seq.spec_token_ids = seq.spec_token_ids[: kept[sid]]
        return sum(len(s.spec_token_ids) for s in proposed.values())

    def after_schedule(
        self, sched: SchedulerOutput, seqs: dict[int, tuple[Sequence, SequenceGroup]]
    ) -> None:
        """Between scheduling and the forward pass: a proposer that drafts on the scheduled
        block tables (``draft_model.DraftModelProposer``) fills in its reserved proposals."""
        hook = getattr(self.proposer, "after_schedule", None)
        if hook is not None:
            hook(sched, seqs)

    # ---- after the step ----------------------------------------------------------------------
    def observe_step(self, sched: SchedulerOutput, seconds: float) -> None:
        """Feed the measured time of a step's forward pass (the part the drafts' rows change;
        sampling and output processing scale with the tokens emitted, which are paid with or
        without speculation) to the draft allocator's cost model when every scheduled sequence
        was decoding or verifying (a prefill chunk would make its rows incomparable)."""
        if self.allocator is None or not sched.scheduled:
            return
        rows = 0
        for _, work in sched.scheduled:
            if len(work.token_ids) != 1 + work.num_spec_tokens or not work.do_sample:
                return
            rows += len(work.token_ids)
        self.allocator.observe_step(rows, seconds)

    def verify(
        self,
        sched: SchedulerOutput,
        seq_ids: list[int],
        logits: torch.Tensor,
        seqs: dict[int, tuple[Sequence, SequenceGroup]],
        sampler: Sampler,
        output: OutputProcessor,
        scheduler: Scheduler,
        stats: EngineStats,
        eos_token_ids: list[int],
        fail: Callable[[SequenceGroup, Exception], None],
    ) -> tuple[list[int], torch.Tensor]:
        """Verify the speculative sequences of the step and emit their tokens.

        Args:
            sched: the step's schedule (``num_spec_tokens`` per sequence).
            seq_ids / logits: the model runner's ``sample_seq_ids`` and logits rows
                ([sum(1 + num_spec_tokens), V] float32, see ``ModelRunnerOutput``).
            seqs: the engine's seq_id -> (sequence, group) map.
            sampler / output / scheduler / stats / eos_token_ids: the engine's parts.
            fail: aborts a request whose own verification (its sampling, its output
                processing) raised, so that the others go on (``EngineCore._fail_request``).

        Returns:
            The sequences without speculative tokens and their logits rows ([n, V]), for the
            engine's ordinary sampling path.
        """
        num_spec = {w.seq_id: w.num_spec_tokens for _, w in sched.scheduled}
        drafts = {w.seq_id: w.token_ids[-w.num_spec_tokens :] for _, w in sched.scheduled}
        plain_ids: list[int] = []
        plain_rows: list[int] = []
        spec: list[tuple[int, int, int]] = []  # (seq_id, first row, k)
        row = 0
        for seq_id in seq_ids:
            k = num_spec.get(seq_id, 0)
            if k:
                spec.append((seq_id, row, k))
            else:
                plain_ids.append(seq_id)
                plain_rows.append(row)
            row += 1 + k
        if not spec:
            return seq_ids, logits
        self._verify_rows(
            spec, drafts, logits, seqs, sampler, output, scheduler, stats, eos_token_ids, fail
        )
        return plain_ids, select_rows(logits, plain_rows)

    def _verify_rows(
        self,
        spec: list[tuple[int, int, int]],
        drafts: dict[int, list[int]],
        logits: torch.Tensor,
        seqs: dict[int, tuple[Sequence, SequenceGroup]],
        sampler: Sampler,
        output: OutputProcessor,
        scheduler: Scheduler,
        stats: EngineStats,
        eos_token_ids: list[int],
        fail: Callable[[SequenceGroup, Exception], None],
    ) -> None:
        """Sample all ``k + 1`` rows of every speculative sequence in one sampler call, keep
        the accepted run, emit it token by token (stop checks), then roll back the rest. A
        request whose rows or output processing raise is failed (``fail``) alone."""
        rows: list[int] = []
        row_groups: list[SequenceGroup] = []
        batch = SamplingBatch([], [], [], [], eos_token_ids)
        pairs = [seqs[seq_id] for seq_id, _, _ in spec]  # a failed request leaves ``seqs``
        for (seq, group), (seq_id, first, k) in zip(pairs, spec, strict=True):
            out_ids = seq.output_token_ids
            for j in range(k + 1):
                rows.append(first + j)
                row_groups.append(group)
                batch.params.append(group.sampling_params)
                batch.seeds.append(seq.seed)
                batch.output_token_ids.append(out_ids + drafts[seq_id][:j])
                batch.prompt_token_ids.append(seq.prompt_token_ids)
        if self.structured is not None:
            batch.token_bitmask = self.structured.fill_draft_bitmask(
                [(*pair, drafts[seq_id][:k]) for pair, (seq_id, _, k) in zip(pairs, spec, strict=True)]
            )
        row_logits = select_rows(logits, rows)
        out = sample_by_request(sampler, row_logits, batch, row_groups, fail)
        # A draft model's sampled proposals: rejection sampling with its probabilities q (not
        # for a request failed above, gone from ``seqs``: its rows hold placeholders).
        draft_probs = getattr(self.proposer, "draft_probs", None)
        if draft_probs and any(g.error is not None for _, g in pairs):
            draft_probs = {sid: q for sid, q in draft_probs.items() if sid in seqs}
        forced = (
            verify_with_draft_probs(
                spec, drafts, row_logits, batch, out, sampler, seqs, draft_probs
            )
            if draft_probs
            else {}
        )
        now = time.monotonic()
        base = 0
        for (seq, group), (seq_id, _, k) in zip(pairs, spec, strict=True):
            if group.error is None:
                try:
                    self._emit(seq, group, drafts[seq_id], k, base, forced.get(seq_id), out,
                               output, scheduler, stats, now)
                except Exception as exc:  # noqa: BLE001 - this request's failure alone
                    fail(group, exc)
            base += k + 1

    def _emit(
        self,
        seq: Sequence,
        group: SequenceGroup,
        draft: list[int],
        k: int,
        base: int,
        forced: int | None,
        out: SamplerOutput,
        output: OutputProcessor,
        scheduler: Scheduler,
        stats: EngineStats,
        now: float,
    ) -> None:
        """One sequence's verification (its rows from ``base`` in ``out``): the accepted
        drafts (``forced`` by rejection sampling, else the longest run ``out`` agrees with)
        plus one token, emitted with stop checks, then the rejected slots rolled back."""
        accepted = forced if forced is not None else 0
        while forced is None and accepted < k and (
            out.sampled_token_ids[base + accepted] == draft[accepted]
        ):
            accepted += 1
        self._record(seq.seq_id, k, accepted, stats)
        start = seq.num_computed_tokens - (k + 1)  # position of the last real token
        for j in range(accepted + 1):
            seq.append_token(out.sampled_token_ids[base + j], out.sampled_logprobs[base + j])
            stats.generation_tokens += 1
            output.process_sample(seq, group, out, base + j)
            if seq.is_finished():
                break
        if group.metrics.first_token_time is None:
            group.metrics.first_token_time = now
        # Valid KV: the last real token and the accepted drafts, never past the new last token.
        valid = min(start + 1 + accepted, seq.num_tokens - 1)
        scheduler.finish_speculation(seq, seq.num_computed_tokens - valid)
        if seq.is_finished():
            self.forget_seq(seq.seq_id)
            if len(group.seqs) > 1:
                scheduler.free_seq(seq)  # a finished sample gives its blocks back at once

    def _record(self, seq_id: int, k: int, accepted: int, stats: EngineStats) -> None:
        """Count one verification and adapt the sequence's ``k``."""
        stats.spec_num_drafts += 1
        stats.spec_draft_tokens += k
        stats.spec_accepted_tokens += accepted
        per_pos = stats.spec_accepted_per_pos
        if len(per_pos) < k:
            per_pos.extend([0] * (k - len(per_pos)))
        for j in range(accepted):
            per_pos[j] += 1
        proposed = stats.spec_draft_per_pos
        if len(proposed) < k:
            proposed.extend([0] * (k - len(proposed)))
        for j in range(k):
            proposed[j] += 1
        if self.allocator is not None:
            self.allocator.record(seq_id, k, accepted)
        elif accepted == k:
            self._k[seq_id] = k + 1
        elif accepted == 0:
            self._k[seq_id] = max(1, k // 2)
        else:
            self._k[seq_id] = k

    def forget_seq(self, seq_id: int) -> None:
        """Drop a sequence's adaptive state."""
        self._k.pop(seq_id, None)
        if self.allocator is not None:
            self.allocator.forget(seq_id)

    def on_request_finished(self, group: SequenceGroup) -> None:
        """Tell the proposer the request's final tokens and drop its sequences' state."""
        for seq in group.seqs:
            self.forget_seq(seq.seq_id)
        if group.seqs:
            seq = group.seqs[0]
            self.proposer.on_request_finished(seq.token_ids, seq.num_prompt_tokens, group.request_id)
