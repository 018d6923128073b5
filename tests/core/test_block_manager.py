"""Block allocator and block manager: exact block ids, reference counts and free-list order."""

import pytest

from pagedllm.core.block_allocator import BlockAllocator, NoFreeBlocksError
from pagedllm.core.block_manager import BlockManager
from pagedllm.sequence import Sequence


def seq(seq_id: int, n_tokens: int) -> Sequence:
    return Sequence(seq_id, list(range(1, n_tokens + 1)), seed=0)


def test_allocator_lru_order_and_refcounts():
    a = BlockAllocator(4)
    assert [a.allocate() for _ in range(3)] == [0, 1, 2]
    assert a.free_block_ids() == [3]
    assert a.incref(1) == 2
    assert a.free(1) == 1 and not a.is_free(1)
    assert a.free(1) == 0 and a.is_free(1)
    a.free(0)
    # Freed blocks go to the back: 3 (never used) first, then 1, then 0.
    assert a.free_block_ids() == [3, 1, 0]
    assert a.allocate() == 3
    with pytest.raises(ValueError, match="double free"):
        a.free(3) or a.free(3)


def test_allocator_exhaustion():
    a = BlockAllocator(1)
    a.allocate()
    with pytest.raises(NoFreeBlocksError):
        a.allocate()


def test_new_block_only_when_last_is_full():
    bm = BlockManager(num_blocks=8, block_size=4, watermark=0)
    s = seq(0, 5)  # 5 prompt tokens -> 2 blocks
    assert bm.allocate_slots(s, 5) == []  # no copy-on-write
    assert bm.get_block_table(s) == [0, 1]
    s.num_computed_tokens = 5
    # tokens 6..8 fit in block 1 (slots 5, 6, 7 of the sequence)
    for n in range(6, 9):
        s.token_ids.append(n)
        bm.allocate_slots(s, 1)
        assert bm.get_block_table(s) == [0, 1]
        s.num_computed_tokens += 1
    s.token_ids.append(9)
    bm.allocate_slots(s, 1)
    assert bm.get_block_table(s) == [0, 1, 2]
    assert bm.allocator.ref_counts[:4] == [1, 1, 1, 0]
    bm.check_invariants()
    bm.free(s)
    assert bm.num_free_blocks == 8
    # Freed tail first: 2, 1, 0 go to the back of the free list in that order.
    assert bm.allocator.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    bm.check_invariants()


def test_can_allocate_respects_watermark():
    bm = BlockManager(num_blocks=10, block_size=4, watermark=0.2)  # keep 2 blocks free
    assert bm.watermark_blocks == 2
    assert bm.can_allocate([seq(0, 32)])  # 8 blocks, leaves 2
    assert not bm.can_allocate([seq(1, 33)])  # 9 blocks, leaves 1
    assert bm.can_append_slots([seq(2, 36)], 36)  # running growth ignores the watermark


def test_allocate_slots_all_or_nothing():
    bm = BlockManager(num_blocks=2, block_size=4, watermark=0)
    s = seq(0, 12)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate_slots(s, 12)
    assert bm.num_free_blocks == 2 and bm.get_block_table(s) == []


def test_invariant_checker_catches_corruption():
    bm = BlockManager(num_blocks=4, block_size=4, watermark=0)
    s = seq(0, 4)
    bm.allocate_slots(s, 4)
    bm.allocator.ref_counts[0] = 2  # a reference without an owner
    with pytest.raises(AssertionError, match="ref count 2 != 1 owners"):
        bm.check_invariants()
