"""Parallel sampling: one prompt, several samples sharing its KV blocks (paper section 4.4,
figure 8).

A request with ``n`` (or ``best_of``) samples runs as one sequence until its first sample: the
prompt's K/V is computed once. At that point the sequence forks into ``num_samples(params)``
sequences whose block tables point at the same physical blocks (reference counts go up); each
child samples from the same logits row with its own seed, ``derive_seed(seed, i)``, and the
first write into a shared, partly filled block copies it (copy-on-write, in
``BlockManager.allocate_slots``).
"""

from __future__ import annotations

from collections.abc import Callable

from pagedllm.core.kv_manager import KVManager
from pagedllm.sampling.sampler import derive_seed
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceGroup


def num_samples(params: SamplingParams) -> int:
    """Sequences a request runs: ``max(n, best_of)`` (samples, or beams with beam search)."""
    return max(params.n, params.best_of or 1)


def fork_samples(
    seq: Sequence, group: SequenceGroup, kv: KVManager, new_seq_id: Callable[[], int]
) -> list[Sequence]:
    """Fork a group's sequence into its parallel samples at the group's first sample.

    Does nothing unless ``seq`` has no output token yet and the group has fewer sequences than
    ``num_samples``. Child ``j`` (``j = len(group.seqs) ..``) gets seed ``derive_seed(seq.seed,
    j)``, a clone of ``seq``'s detokenizer, and every block of ``seq`` (``kv.fork``); it is
    appended to ``group.seqs``.

    Args:
        seq: the group's sequence about to take its first sample.
        group: its request.
        kv: the KV manager (shares the blocks).
        new_seq_id: returns a fresh sequence id per call.

    Returns:
        The new sequences (they sample from ``seq``'s logits row in this same step).

    Raises:
        ValueError: from ``kv.fork`` when the manager cannot share blocks.
    """
    want = num_samples(group.sampling_params)
    if len(group.seqs) >= want or seq.num_output_tokens != 0:
        return []
    children = []
    for j in range(len(group.seqs), want):
        child = seq.fork(new_seq_id(), derive_seed(seq.seed, j))
        if seq.detokenizer is not None:
            child.detokenizer = seq.detokenizer.clone()
        kv.fork(seq, child)
        group.seqs.append(child)
        children.append(child)
    return children
