"""Sharing in the block manager: fork, copy-on-write, prefix-cache reuse and LRU eviction,
with exact block ids and reference counts."""

from pagedllm.core.block_manager import BlockManager
from pagedllm.sequence import Sequence


def seq(seq_id: int, tokens: list[int], salt: bytes | None = None) -> Sequence:
    return Sequence(seq_id, list(tokens), seed=0, cache_salt=salt)


def computed(bm: BlockManager, s: Sequence, n: int) -> None:
    """Allocate and 'compute' n more tokens of s, as a scheduler step would."""
    pairs = bm.allocate_slots(s, n)
    s.num_computed_tokens += n
    bm.mark_computed(s)
    return pairs


def test_fork_then_copy_on_write_of_the_last_block_only():
    bm = BlockManager(8, 4, watermark=0)
    parent = seq(0, range(1, 7))  # 6 tokens: blocks 0 (full) and 1 (2 of 4 slots)
    computed(bm, parent, 6)
    child = parent.fork(1, seed=1)
    bm.fork(parent, child)
    assert bm.get_block_table(child) == [0, 1]
    assert bm.allocator.ref_counts[:2] == [2, 2]
    bm.check_invariants()
    # Both append a token: position 6 lands in shared block 1.
    parent.token_ids.append(50)
    child.token_ids.append(60)
    assert bm.num_new_blocks_needed(child, 1) == 1
    assert computed(bm, child, 1) == [(1, 2)]  # copy block 1 into the new block 2
    assert bm.get_block_table(child) == [0, 2]
    assert bm.allocator.ref_counts[:3] == [2, 1, 1]
    assert computed(bm, parent, 1) == []  # block 1 now has one owner: written in place
    assert bm.get_block_table(parent) == [0, 1]
    bm.check_invariants()
    # The full first block stays shared as both grow into new blocks.
    for t in range(2):
        parent.token_ids.append(t)
        child.token_ids.append(t)
        assert computed(bm, parent, 1) == [] and computed(bm, child, 1) == []
    assert bm.get_block_table(parent) == [0, 1, 3] and bm.get_block_table(child) == [0, 2, 4]
    assert bm.allocator.ref_counts[0] == 2
    bm.free(child)
    assert bm.allocator.ref_counts[:5] == [1, 1, 0, 1, 0]
    bm.free(parent)
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_prefix_cache_reuse_keeps_at_least_the_last_token():
    bm = BlockManager(8, 4, watermark=0)
    a = seq(0, range(1, 10))  # 9 tokens: blocks 0, 1 full, 2 partial
    computed(bm, a, 9)
    assert bm.prefix_cache.key_of.keys() == {0, 1}
    bm.free(a)  # cached blocks stay findable while free
    assert bm.num_cached_free_blocks == 2
    b = seq(1, list(range(1, 9)) + [99, 98])  # shares the first 8 tokens
    assert bm.cached_prefix_blocks(b) == [0, 1]
    assert bm.can_allocate([b])
    assert bm.allocate_prefix(b) == 8
    assert bm.get_block_table(b) == [0, 1] and bm.allocator.ref_counts[:2] == [1, 1]
    # A prompt that is entirely cached still computes its last block's tokens.
    c = seq(2, range(1, 9))
    assert bm.cached_prefix_blocks(c) == [0]
    assert bm.allocate_prefix(c) == 4
    assert bm.allocator.ref_counts[0] == 2
    bm.check_invariants()
    assert bm.prefix_cache.hits == 3 and bm.prefix_cache.queries == 3


def test_reset_prefix_cache_drops_free_blocks_only():
    bm = BlockManager(8, 4, watermark=0)
    a = seq(0, range(1, 10))  # blocks 0, 1 full and cached
    computed(bm, a, 9)
    b = seq(1, range(21, 30))  # blocks 3, 4 full and cached, b stays live
    computed(bm, b, 9)
    assert bm.get_block_table(b) == [3, 4, 5]
    bm.free(a)
    assert bm.reset_prefix_cache() == 2  # a's blocks 0, 1; b's stay cached while it runs
    assert bm.prefix_cache.key_of.keys() == {3, 4}
    assert bm.cached_prefix_blocks(seq(2, range(1, 10))) == []
    assert bm.cached_prefix_blocks(seq(3, range(21, 30))) == [3, 4]
    bm.check_invariants()
    assert BlockManager(8, 4, enable_prefix_caching=False).reset_prefix_cache() == 0


def test_same_tokens_different_parent_do_not_collide():
    """C19: a block of [321]*4 after [65]*4 is not the block [321]*4 at the start."""
    bm = BlockManager(8, 4, watermark=0)
    a = seq(0, [65] * 4 + [321] * 4 + [7])
    computed(bm, a, 9)
    b = seq(1, [321] * 4 + [65] * 4 + [7])
    assert bm.cached_prefix_blocks(b) == []
    salted = seq(2, [65] * 4 + [321] * 4 + [7], salt=b"tenant-2")
    assert bm.cached_prefix_blocks(salted) == []
    assert bm.cached_prefix_blocks(seq(3, [65] * 4 + [321] * 4 + [7])) == [0, 1]


def test_lru_eviction_takes_never_used_then_tail_blocks_first():
    bm = BlockManager(4, 4, watermark=0)
    a = seq(0, range(1, 13))  # 12 tokens: blocks 0, 1, 2 all full and cached
    computed(bm, a, 12)
    bm.free(a)
    # Tail first: 2, 1, 0 go behind the never-used block 3.
    assert bm.allocator.free_block_ids() == [3, 2, 1, 0]
    other = seq(1, range(100, 106))  # needs 2 blocks: takes 3, then evicts 2 (a's tail)
    bm.allocate_slots(other, 6)
    assert bm.get_block_table(other) == [3, 2]
    assert not bm.prefix_cache.is_cached(2) and bm.prefix_cache.evictions == 1
    again = seq(2, list(range(1, 13)) + [5])
    assert bm.cached_prefix_blocks(again) == [0, 1]  # head blocks survived
    bm.check_invariants()


def test_disabled_prefix_cache_never_hits():
    bm = BlockManager(8, 4, watermark=0, enable_prefix_caching=False)
    a = seq(0, range(1, 10))
    computed(bm, a, 9)
    bm.free(a)
    assert bm.cached_prefix_blocks(seq(1, range(1, 10))) == []


def test_a_shared_last_block_costs_one_copy_less_than_its_writers():
    """Three samples share a partly filled block: the first two writers copy it, the last
    writes in place, so the plan needs 2 blocks, not 3 (counting 3 capped such groups one
    block early)."""
    bm = BlockManager(5, 4, watermark=0)
    parent = seq(0, range(1, 7))  # blocks 0 (full) and 1 (2 of 4 slots)
    computed(bm, parent, 6)
    kids = [parent.fork(i, seed=i) for i in (1, 2)]
    for k in kids:
        bm.fork(parent, k)
    trio = [parent, *kids]
    for s in trio:
        s.token_ids.append(9)
    assert [bm.num_new_blocks_needed(s, 1) for s in trio] == [1, 1, 1]
    assert bm.num_blocks_needed([(s, 1) for s in trio]) == 2
    assert bm.num_blocks_needed([(s, 1) for s in trio[:2]]) == 2  # the third still holds it
    assert bm.num_blocks_needed([(parent, 5)]) == 2  # a copy of block 1 and a new block
    assert bm.can_append_slots(trio, 1) and bm.num_free_blocks == 3
    assert [computed(bm, s, 1) for s in trio] == [[(1, 2)], [(1, 3)], []]
    assert [bm.get_block_table(s) for s in trio] == [[0, 2], [0, 3], [0, 1]]
    assert bm.allocator.ref_counts == [3, 1, 1, 1, 0]
    bm.check_invariants()


def test_a_readmitted_group_counts_each_free_cached_block_once():
    """Three samples of a 15-token prompt, preempted by recompute with 2 output tokens each,
    come back to a pool where the prompt's 3 full blocks and sample c's 4th block are cached
    and free. They need 9 blocks (the 3 prompt blocks once, 2 new each, c's own cached 4th
    block): each free cached hit used to be counted once per sample (15), so the group never
    came back although the whole pool was free."""
    bm = BlockManager(9, 4, watermark=0)
    prompt = list(range(1, 16))
    samples = []
    for i, outs in enumerate(([50, 51], [60, 61], [70, 71])):
        s = seq(i, prompt)
        for t in outs:
            s.append_token(t, 0.0)
        samples.append(s)
    c = samples[2]
    computed(bm, c, 16)  # blocks 0-3 full and cached
    bm.free(c)
    c.num_computed_tokens = 0
    assert bm.num_free_blocks == 9 and bm.num_cached_free_blocks == 4
    assert [len(bm.cached_prefix_blocks(s)) for s in samples] == [3, 3, 4]
    assert bm.group_shared_blocks(samples) == 3
    assert bm.can_allocate(samples, watermark=False)
    for s in samples:  # what the scheduler does: own hits, then the rest computed
        s.num_computed_tokens = bm.allocate_prefix(s)
        computed(bm, s, s.num_tokens - s.num_computed_tokens)
    assert [bm.get_block_table(s)[:4] for s in samples] == [[0, 1, 2, 4], [0, 1, 2, 6], [0, 1, 2, 3]]
    assert bm.num_free_blocks == 0 and bm.allocator.ref_counts[:3] == [3, 3, 3]
    bm.check_invariants()
