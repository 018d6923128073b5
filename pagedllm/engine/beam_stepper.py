"""One beam-search step on the KV blocks: the block tree of the paper (section 4.4, figure 9).

``engine.beam_search.BeamSearch`` decides, without touching memory, which ``(parent beam, next
token)`` pairs survive a step. ``beam_step`` applies that decision to a request's sequences: a
parent's first kept child continues the parent's own sequence, every further child forks the
parent's blocks (shared by reference count, copied on write when it grows into a shared block),
and parents with no kept child are freed. Sequences of a beam request therefore form a tree of
shared blocks whose leaves are the live beams.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedllm.core.kv_manager import KVManager
from pagedllm.engine.beam_search import BeamHypothesis
from pagedllm.outputs import PositionLogprobs
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass
class BeamStepResult:
    """What a beam step changed in the request's sequences.

    Attributes:
        forked: new sequences (children forked from a parent kept more than once).
        dropped: pruned beams: their blocks are freed, their status is ``FINISHED_ABORTED``.
        num_new_tokens: tokens appended to the live beams (one per kept beam).
    """

    forked: list[Sequence] = field(default_factory=list)
    dropped: list[Sequence] = field(default_factory=list)
    num_new_tokens: int = 0


def beam_step(
    group: SequenceGroup,
    logits: torch.Tensor,
    kv: KVManager,
    new_seq_id: Callable[[], int],
    entry_of: Callable[[torch.Tensor, int], PositionLogprobs] | None = None,
) -> BeamStepResult:
    """One beam-search step for a group whose live beams all reached their end.

    Kept candidates become the new live beams (``group.seqs``), in the order ``BeamSearch.step``
    returns them. When the search is done (or nothing is kept), ``group.beam_results`` gets the
    best ``n`` hypotheses and the live beams are marked ``FINISHED_STOPPED``; the caller frees
    them with the rest of the finished request.

    Args:
        group: a beam-search request (``group.beam`` is its ``BeamSearch``).
        logits: ``[len(group.seqs), vocab]`` raw logits, row ``i`` for ``group.seqs[i]``.
        kv: the KV manager (forks and frees blocks).
        new_seq_id: returns a fresh sequence id per call.
        entry_of: ``(logprob row [V] float32, token) -> `` the token's logprob entry, when the
            request asks for ``logprobs``: every live beam and finished hypothesis then carries
            one entry per generated token (``Sequence.output_logprobs``,
            ``BeamHypothesis.logprobs``).

    Returns:
        The sequences forked and dropped, and the tokens appended.
    """
    beam = group.beam
    live = group.seqs
    result = BeamStepResult()
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    kept = beam.step(logprobs, [(s.output_token_ids, s.cumulative_logprob) for s in live])
    if entry_of is not None:
        _hypothesis_logprobs(beam.hypotheses, live, logprobs, entry_of)
    used: set[int] = set()
    new_live: list[Sequence] = []
    plan: list[tuple[Sequence, int, int, float]] = []
    for parent_row, token, cum in kept:
        parent = live[parent_row]
        if parent_row in used:
            child = parent.fork(new_seq_id(), parent.seed)
            kv.fork(parent, child)
            result.forked.append(child)
            plan.append((child, parent_row, token, cum))
            new_live.append(child)
        else:
            used.add(parent_row)
            plan.append((parent, parent_row, token, cum))
            new_live.append(parent)
    if kept:
        for row, seq in enumerate(live):
            if row not in used:
                seq.status = SequenceStatus.FINISHED_ABORTED
                kv.free(seq)
                result.dropped.append(seq)
        for seq, parent_row, token, cum in plan:
            seq.token_ids.append(token)
            seq.cumulative_logprob = cum
            if entry_of is not None:
                seq.output_logprobs.append(entry_of(logprobs[parent_row], token))
        result.num_new_tokens = len(plan)
        group.seqs = new_live
    else:
        new_live = live
    if group.metrics.first_token_time is None:
        group.metrics.first_token_time = time.monotonic()
    if beam.done or not kept:
        group.beam_results = _finalize(group, new_live, entry_of is not None)
        for seq in new_live:
            seq.status = SequenceStatus.FINISHED_STOPPED
    return result


def finish_beam_by_length(group: SequenceGroup) -> None:
    """End a beam search the scheduler cut short (no blocks to grow, even alone in the pool):
    its live beams enter the finished set as if they had reached ``max_tokens``, and
    ``group.beam_results`` gets the best ``n``, so the request finishes and its blocks are
    freed (before, the group stayed running forever, holding them). A search cut before its
    first token returns ``n`` empty hypotheses."""
    if group.beam is None or group.beam_results is not None:
        return
    results = _finalize(group, group.seqs, group.sampling_params.logprobs is not None)
    group.beam_results = results or [
        BeamHypothesis([], 0.0, 0.0, False, []) for _ in range(group.sampling_params.n)
    ]


def _finalize(
    group: SequenceGroup, live: list[Sequence], with_logprobs: bool
) -> list[BeamHypothesis]:
    """The best ``n`` hypotheses of ``group``'s search, ``live`` beams entering the finished
    set; those live beams give their logprob entries to the hypotheses they became."""
    assert group.beam is not None
    results = group.beam.finalize(
        [(s.output_token_ids, s.cumulative_logprob) for s in live], group.sampling_params.n
    )
    if with_logprobs:
        by_tokens = {tuple(s.output_token_ids): s for s in live}
        for h in results:
            if h.logprobs is None and (s := by_tokens.get(tuple(h.token_ids))) is not None:
                h.logprobs = list(s.output_logprobs)
    return results


def _hypothesis_logprobs(
    hypotheses: list[BeamHypothesis],
    live: list[Sequence],
    logprobs: torch.Tensor,
    entry_of: Callable[[torch.Tensor, int], PositionLogprobs],
) -> None:
    """Give the hypotheses this step finished (those without entries yet) their logprob
    entries: those of the live beam they extend (its tokens are all but their last), plus their
    last token's from that beam's row of ``logprobs``. Runs before the step's tokens are
    appended."""
    rows = {tuple(s.output_token_ids): row for row, s in enumerate(live)}
    for h in hypotheses:
        if h.logprobs is not None:
            continue
        row = rows.get(tuple(h.token_ids[:-1]))
        if row is not None:
            h.logprobs = [*live[row].output_logprobs, entry_of(logprobs[row], h.token_ids[-1])]
