"""Block-manager rollback of rejected speculative tokens: exact block ids and reference counts,
and no block holding a rejected token enters the prefix cache (issue 25)."""

import pytest

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.outputs import RequestMetrics
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceGroup


def _prefilled(bm: BlockManager, seq_id: int, n: int) -> Sequence:
    seq = Sequence(seq_id, list(range(1, n + 1)), seed=0)
    bm.allocate_slots(seq, n)
    seq.num_computed_tokens = n
    bm.mark_computed(seq)
    return seq


def test_rollback_frees_the_new_blocks_newest_first():
    bm = BlockManager(num_blocks=8, block_size=4, watermark=0.0, enable_prefix_caching=False)
    seq = _prefilled(bm, 0, 6)  # blocks 0, 1 (6 of 8 slots)
    assert bm.get_block_table(seq) == [0, 1]
    seq.token_ids.append(7)  # the decode's last real token at position 6
    bm.allocate_slots(seq, 1 + 5)  # + 5 speculative tokens: positions 6..11 -> blocks 2
    assert bm.get_block_table(seq) == [0, 1, 2]
    seq.num_computed_tokens += 6
    # 2 drafts accepted: positions 6, 7, 8 valid (9 tokens), 3 rejected.
    assert bm.rollback_slots(seq, 3) == []  # block 2 still holds position 8
    assert seq.num_computed_tokens == 9
    assert bm.get_block_table(seq) == [0, 1, 2]
    # Nothing accepted: back to 7 tokens -> blocks 0, 1 only; block 2 freed.
    assert bm.rollback_slots(seq, 2) == [2]
    assert bm.get_block_table(seq) == [0, 1]
    assert bm.ref_counts()[:4] == [1, 1, 0, 0]
    assert bm.num_free_blocks == 6
    bm.check_invariants()
    with pytest.raises(ValueError, match="num_tokens must be in"):
        bm.rollback_slots(seq, 8)
    with pytest.raises(ValueError, match="num_tokens must be in"):
        bm.rollback_slots(seq, -1)


def test_rollback_spanning_several_blocks_and_a_cow_block():
    bm = BlockManager(num_blocks=10, block_size=4, watermark=0.0, enable_prefix_caching=False)
    parent = _prefilled(bm, 0, 6)  # [0, 1]
    child = Sequence(1, parent.prompt_token_ids, seed=0)
    child.num_computed_tokens = 6
    bm.fork(parent, child)  # shares blocks 0, 1 (ref 2 each)
    child.token_ids.append(9)
    copies = bm.allocate_slots(child, 1 + 8)  # CoW of block 1 -> 2, then positions 8..14: 3, 4
    assert copies == [(1, 2)]
    assert bm.get_block_table(child) == [0, 2, 3, 4]
    child.num_computed_tokens += 9
    assert bm.rollback_slots(child, 8) == [4, 3]  # only the last real token kept (7 tokens)
    assert bm.get_block_table(child) == [0, 2]  # the copied block stays: it holds position 6
    assert bm.get_block_table(parent) == [0, 1]
    assert bm.ref_counts()[:5] == [2, 1, 1, 0, 0]
    bm.check_invariants()


def test_rejected_tokens_never_reach_the_prefix_cache():
    bm = BlockManager(num_blocks=8, block_size=4, watermark=0.0, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), bm)
    seq = Sequence(0, [1, 2, 3, 4, 5, 6], seed=0)
    sched.add_seq_group(
        SequenceGroup("r", [seq], SamplingParams(max_tokens=20), None, 0, RequestMetrics(0.0), 20)
    )
    out = sched.schedule()
    sched.on_step_done(out)
    assert seq.num_computed_tokens == 6 and bm.prefix_cache is not None
    assert len(bm.prefix_cache.block_of) == 1  # block 0 (tokens 1..4) registered
    seq.token_ids.append(7)
    seq.spec_token_ids = [8, 9, 10, 11]  # positions 7..10: block 1 would fill with 5..8
    out = sched.schedule()
    (_, work), = out.scheduled
    assert work.token_ids == [7, 8, 9, 10, 11] and work.num_spec_tokens == 4
    assert work.block_table == [0, 1, 2] and seq.spec_token_ids == []
    sched.on_step_done(out)
    assert len(bm.prefix_cache.block_of) == 1  # nothing registered before verification
    seq.token_ids.append(8)  # draft 8 accepted, 9 rejected: the target said 42
    seq.token_ids.append(42)
    sched.finish_speculation(seq, 3)  # keep positions 0..7 (6 + last real + 1 accepted)
    assert seq.num_computed_tokens == 8
    assert bm.get_block_table(seq) == [0, 1]
    assert bm.ref_counts()[:3] == [1, 1, 0]
    # Block 1 is full of accepted tokens 5, 6, 7, 8: registered under their hash, and no key
    # of a rejected token exists.
    assert bm.prefix_cache.key_of[1] == seq.block_hashes[1]
    assert set(bm.prefix_cache.key_of) == {0, 1}
    bm.check_invariants()
