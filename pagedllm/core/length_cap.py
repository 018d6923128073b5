"""The bound of the scheduler's length cap (``core.scheduler``): the blocks a running group would
have with every other running group preempted, the largest next step of the group that fits
in them, and the blocks a waiting group needs to be admitted.

The oldest running group is finished by length only when even its smallest step does not fit
with the pool to itself. Its smallest step computes one token of each sequence it schedules, not
the chunks the token budget allows: with a sliding window a sequence holds only the blocks of its
window, so a prefix recomputed chunk by chunk fits where the same prefix in one chunk does not
(the window frees the blocks behind each chunk after its step). For the same reason a waiting
group readmitted with the pool to itself (chunked prefill) needs only its lead's first chunk to
fit, not its whole sequences: it is finished by length only when not even that fits.

Units: blocks (``KVManager.num_blocks_needed``); a plan is ``[(sequence, tokens to compute)]``.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from pagedllm.core.kv_manager import FREED_BLOCK

if TYPE_CHECKING:
    from pagedllm.core.kv_manager import KVManager
    from pagedllm.sequence import Sequence, SequenceGroup

__all__ = ["admission_room", "fit_plan", "free_when_alone"]


def free_when_alone(kv: KVManager, running: list[SequenceGroup], group: SequenceGroup) -> int:
    """Free blocks there would be with every running group but ``group`` preempted.

    Args:
        kv: the KV manager.
        running: the running groups (``group`` may be one of them).
        group: the group to keep.

    Returns:
        ``kv.num_free_blocks`` plus the blocks that only the other running groups' unfinished
        sequences hold (a block ``group`` shares with them stays taken).
    """
    refs: Counter[int] = Counter(
        b
        for g in running
        if g is not group
        for s in g.unfinished_seqs()
        for b in kv.get_block_table(s)
        if b != FREED_BLOCK
    )
    counts = kv.ref_counts()
    return kv.num_free_blocks + sum(1 for b, n in refs.items() if counts[b] == n)


def fit_plan(
    kv: KVManager, plan: list[tuple[Sequence, int]], max_blocks: int
) -> list[tuple[Sequence, int]]:
    """``plan`` with its chunks cut so that it takes at most ``max_blocks`` new blocks.

    Every sequence of ``plan`` keeps at least one token (a group steps all its scheduled
    sequences, or is finished by length); the blocks left go to the sequences in plan order,
    each getting the longest chunk, up to its planned tokens, that still fits.

    Args:
        kv: the KV manager (its ``num_blocks_needed`` counts growth and copy-on-writes).
        plan: ``[(sequence, tokens)]``, each with ``tokens >= 1``.
        max_blocks: new blocks the plan may take.

    Returns:
        The cut plan (same sequences, same order), or ``[]`` when one token of each sequence
        already needs more than ``max_blocks`` blocks.
    """
    fitted = [(seq, 1) for seq, _ in plan]
    if kv.num_blocks_needed(fitted) > max_blocks:
        return []
    for i, (seq, n) in enumerate(plan):
        lo, hi = 1, n  # the need grows with the chunk: the longest chunk that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            fitted[i] = (seq, mid)
            if kv.num_blocks_needed(fitted) <= max_blocks:
                lo = mid
            else:
                hi = mid - 1
        fitted[i] = (seq, lo)
    return fitted


def admission_room(
    kv: KVManager, seqs: list[Sequence], watermark: bool, chunk_alone: bool
) -> int | None:
    """Whether waiting ``seqs`` (a group, its lead first) can be admitted now, and on what.

    Args:
        kv: the KV manager.
        seqs: the group's unfinished sequences.
        watermark: keep the manager's watermark free (other groups run).
        chunk_alone: chunked prefill with the pool to the group (nothing runs or is swapped
            out): then only the lead's first chunk must fit (``KVManager.first_chunk_room``:
            with a sliding window; the others wait for the lead, and the group, the oldest,
            has its later chunks cut to the pool, ``fit_plan``). While others run a group waits
            for its whole sequences: admitted on a chunk beside them, the newest group would be
            preempted again before its recompute is done.

    Returns:
        None when the whole sequences fit (``kv.can_allocate``); else the new blocks the lead's
        first chunk may take, 0 when the group is not admitted.
    """
    if kv.can_allocate(seqs, watermark=watermark):
        return None
    return kv.first_chunk_room(seqs) if chunk_alone else 0
