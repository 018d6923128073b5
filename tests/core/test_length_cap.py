"""The length cap's bound (``core.length_cap``): the blocks a group would have alone in the pool
and the plan of its next step cut to them, with exact block counts."""

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.length_cap import fit_plan, free_when_alone
from pagedllm.outputs import RequestMetrics
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceGroup


def computed(bm: BlockManager, seq_id: int, n_tokens: int) -> Sequence:
    """A sequence whose ``n_tokens`` tokens are all in the cache (blocks allocated)."""
    s = Sequence(seq_id, list(range(1, n_tokens + 1)), seed=0)
    bm.allocate_slots(s, n_tokens)
    s.num_computed_tokens = n_tokens
    return s


def test_chunks_are_cut_in_plan_order_one_token_each_at_least():
    bm = BlockManager(8, 4, watermark=0, enable_prefix_caching=False)
    a = computed(bm, 0, 10)  # blocks 0-2, position 10 still in block 2
    a.append_token(99, 0.0)
    b = Sequence(1, list(range(1, 14)), seed=0)  # 13 tokens, no blocks yet
    c = Sequence(2, list(range(1, 10)), seed=0)  # 9 tokens, no blocks yet
    assert bm.num_free_blocks == 5 and bm.num_blocks_needed([(a, 1), (b, 13)]) == 4
    assert fit_plan(bm, [(a, 1), (b, 13)], 5) == [(a, 1), (b, 13)]  # fits: unchanged
    assert fit_plan(bm, [(a, 1), (b, 13)], 2) == [(a, 1), (b, 8)]  # 2 blocks of b's chunk
    assert fit_plan(bm, [(a, 1), (b, 13)], 0) == []  # b's first token needs a block
    # The first sequence takes what the others' single tokens leave.
    assert fit_plan(bm, [(b, 13), (c, 9)], 3) == [(b, 8), (c, 4)]
    assert fit_plan(bm, [(c, 9), (b, 13)], 3) == [(c, 8), (b, 4)]
    assert bm.num_free_blocks == 5  # fit_plan only counts
    bm.check_invariants()


def test_copies_of_a_shared_last_block_count_once_per_copy():
    """Three samples writing their shared, partly filled last block: 2 copies, not 3."""
    bm = BlockManager(4, 4, watermark=0, enable_prefix_caching=False)
    lead = computed(bm, 0, 6)  # blocks 0, 1 (1 half full)
    samples = [lead]
    for i in (1, 2):
        child = lead.fork(i, seed=i)
        bm.fork(lead, child)
        samples.append(child)
    for i, s in enumerate(samples):
        s.append_token(50 + i, 0.0)
    plan = [(s, 1) for s in samples]
    assert bm.ref_counts() == [3, 3, 0, 0]
    assert fit_plan(bm, plan, 2) == plan
    assert fit_plan(bm, plan, 1) == []


def group(rid: str, seqs: list[Sequence], arrival: int) -> SequenceGroup:
    return SequenceGroup(rid, seqs, SamplingParams(), None, arrival, RequestMetrics(0.0))


def test_free_when_alone_counts_blocks_only_the_others_hold():
    bm = BlockManager(8, 4, watermark=0, enable_prefix_caching=False)
    a = computed(bm, 0, 8)  # blocks 0, 1
    b = Sequence(1, list(range(1, 8 + 5)), seed=0)
    bm.fork(a, b)  # b reads a's blocks 0, 1 (as a prefix-cache hit would) ...
    b.num_computed_tokens = 8
    bm.allocate_slots(b, 5)  # ... and holds blocks 2, 3 of its own
    ga, gb = group("a", [a], 0), group("b", [b], 1)
    assert bm.ref_counts()[:4] == [2, 2, 1, 1] and bm.num_free_blocks == 4
    assert free_when_alone(bm, [ga, gb], ga) == 4 + 2  # blocks 0, 1 stay a's
    assert free_when_alone(bm, [ga, gb], gb) == 4  # b alone still reads 0 and 1
    assert free_when_alone(bm, [gb], gb) == 4  # nothing else runs
