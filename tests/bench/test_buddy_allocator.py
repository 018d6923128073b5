"""Buddy allocator: exact chunk ids, splits, merges, and stranded free memory."""

import pytest

from pagedllm.core.block_allocator import NoFreeBlocksError
from pagedllm.core.buddy_allocator import BuddyAllocator, order_for


def test_order_for():
    assert [order_for(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 2, 2, 3, 3, 4]
    with pytest.raises(ValueError, match="num_blocks"):
        order_for(0)


def test_split_gives_lowest_chunk_and_frees_upper_buddies():
    b = BuddyAllocator(16)
    assert b.allocate(3) == (0, 4)  # 16 -> 8 + [8] -> 4 + [4] -> take 0..3
    assert sorted(b.free_chunks[2]) == [4] and sorted(b.free_chunks[3]) == [8]
    assert b.allocate(1) == (4, 1)  # splits 4..7 into 4, [5], [6..7]
    assert sorted(b.free_chunks[0]) == [5] and sorted(b.free_chunks[1]) == [6]
    assert b.num_free == 16 - 4 - 1
    assert b.largest_free_chunk() == 8
    b.check_invariants()


def test_free_merges_buddies_back_to_the_root():
    b = BuddyAllocator(16)
    a = [b.allocate(4)[0] for _ in range(4)]
    assert a == [0, 4, 8, 12] and b.num_free == 0
    with pytest.raises(NoFreeBlocksError):
        b.allocate(1)
    b.free(4)
    b.free(8)  # 4 and 8 are not buddies: no merge
    assert b.largest_free_chunk() == 4 and b.num_free == 8
    assert not b.can_allocate(8)  # 8 blocks free, but not contiguous-aligned
    b.free(0)  # merges with 4 -> chunk 0..7
    assert b.largest_free_chunk() == 8
    b.free(12)  # merges with 8 -> 8..15, then with 0..7 -> 0..15
    assert b.free_chunks[4] == {0} and b.num_free == 16
    b.check_invariants()
    with pytest.raises(ValueError, match="start"):
        b.free(12)  # double free


def test_pool_not_a_power_of_two_has_roots_that_never_merge():
    b = BuddyAllocator(12)  # roots 0..7 and 8..11
    assert b.max_chunk_blocks == 8
    assert b.allocate(4) == (8, 4)  # smallest sufficient order first: the 4-block root
    assert b.allocate(5) == (0, 8)
    with pytest.raises(ValueError, match="num_blocks"):
        b.allocate(9)
    b.free(8)
    b.free(0)
    assert b.free_chunks[3] == {0} and b.free_chunks[2] == {8}
    assert b.free_block_ids() == list(range(12))
    b.check_invariants()


def test_ref_counts_mark_allocated_chunks():
    b = BuddyAllocator(8)
    b.allocate(2)
    assert b.ref_counts == [1, 1, 0, 0, 0, 0, 0, 0]
    assert not b.is_free(1) and b.is_free(2) and b.is_free(7)
