"""Block freeing behind a sliding window in the paged block manager: exact block ids, reference
counts and free lists through decode, prefix caching, forks, swapping and recompute."""

from __future__ import annotations

import pytest

from pagedllm.core.block_manager import FREED_BLOCK, BlockManager
from pagedllm.sequence import Sequence

F = FREED_BLOCK


def seq(seq_id: int, n_tokens: int, first: int = 1) -> Sequence:
    return Sequence(seq_id, list(range(first, first + n_tokens)), seed=0)


def step(bm: BlockManager, s: Sequence, n: int) -> None:
    """Schedule ``n`` tokens of ``s`` and mark them computed (what one engine step does)."""
    bm.allocate_slots(s, n)
    s.num_computed_tokens += n
    bm.mark_computed(s)
    bm.check_invariants()


def free_all(bm: BlockManager, *seqs: Sequence) -> None:
    """Finish ``seqs``: the whole pool must be free again, with consistent bookkeeping."""
    for s in seqs:
        bm.free(s)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


def decode(bm: BlockManager, s: Sequence, token: int = 1000) -> None:
    s.token_ids.append(token)
    step(bm, s, 1)


def test_decode_frees_blocks_behind_the_window_exactly():
    # window 6, blocks of 4: the query at position p reads p - 5 .. p.
    bm = BlockManager(num_blocks=10, block_size=4, watermark=0, sliding_window=6)
    s = seq(0, 9)  # positions 0..8 -> blocks 0, 1, 2
    step(bm, s, 9)
    # next position 9 reads 4..9: block 0 (positions 0..3) is freed.
    assert bm.get_block_table(s) == [F, 1, 2]
    assert bm.allocator.ref_counts[:3] == [0, 1, 1]
    assert bm.num_live_blocks(s) == 2 and bm.num_free_blocks == 8
    held = []  # blocks held while the step computing position p runs (the peak)
    for p in range(9, 21):
        s.token_ids.append(1000)
        bm.allocate_slots(s, 1)
        held.append(bm.num_live_blocks(s))
        assert len(bm.get_block_table(s)) == p // 4 + 1  # the length is kept
        s.num_computed_tokens += 1
        bm.mark_computed(s)
        bm.check_invariants()
    # position p reads p - 5 .. p: a new block at p = 12, 16, 20 before the oldest goes
    assert held == [2, 2, 2, 3, 2, 2, 2, 3, 2, 2, 2, 3]
    # next position 21 reads 16..21: blocks 0..3 are freed
    assert bm.get_block_table(s) == [F, F, F, F, 4, 5]
    assert max(held) <= -(-6 // 4) + 1
    free_all(bm, s)


def test_no_window_frees_nothing_and_bad_window_is_refused():
    bm = BlockManager(num_blocks=10, block_size=4, watermark=0)
    s = seq(0, 30)
    step(bm, s, 30)
    assert FREED_BLOCK not in bm.get_block_table(s)
    with pytest.raises(ValueError, match="sliding_window"):
        BlockManager(num_blocks=10, block_size=4, sliding_window=0)


def test_prefix_hit_beyond_window_takes_only_live_blocks():
    bm = BlockManager(num_blocks=16, block_size=4, watermark=0, sliding_window=5)
    a = seq(0, 17)  # 4 full blocks + 1 token
    step(bm, a, 17)
    table_a = list(bm.get_block_table(a))
    assert table_a == [F, F, F, 3, 4]  # next position 17 reads 13..17
    bm.free(a)
    assert bm.num_free_blocks == 16
    # Blocks 0..2 were freed while a ran but stay cached (registered before they were freed).
    assert sorted(bm.prefix_cache.key_of) == [0, 1, 2, 3]
    b = seq(1, 19)  # same first 17 tokens, then two more
    hits = bm.cached_prefix_blocks(b)
    assert hits == [0, 1, 2, 3]
    b.num_computed_tokens = bm.allocate_prefix(b)
    assert b.num_computed_tokens == 16
    # Position 16 reads 12..16: only block 3 of the hits is taken.
    assert bm.get_block_table(b) == [F, F, F, 3]
    assert bm.allocator.ref_counts[:5] == [0, 0, 0, 1, 0]
    bm.check_invariants()
    step(bm, b, 3)
    assert bm.get_block_table(b)[:3] == [F, F, F]
    free_all(bm, b)


def test_a_freed_then_reused_block_is_no_longer_a_cache_hit():
    bm = BlockManager(num_blocks=4, block_size=2, watermark=0, sliding_window=2)
    a = seq(0, 6)
    step(bm, a, 6)  # blocks 0, 1, 2; next position 6 reads 5..6 -> 1 then 0 freed
    assert bm.get_block_table(a) == [F, F, 2]
    assert bm.allocator.free_block_ids() == [3, 1, 0]
    assert sorted(bm.prefix_cache.key_of) == [0, 1, 2]
    other = seq(1, 4, first=500)  # unrelated tokens take blocks 3 and 1 (1's key is evicted)
    step(bm, other, 4)
    assert bm.get_block_table(other) == [F, 1]
    assert bm.prefix_cache.key_of[1] == other.block_hashes[1]
    c = seq(2, 6)  # a's prompt again: block 0 still holds its first block, block 1 does not
    assert bm.cached_prefix_blocks(c) == [0]
    c.num_computed_tokens = bm.allocate_prefix(c)
    assert c.num_computed_tokens == 2 and bm.get_block_table(c) == [0]
    assert bm.allocator.ref_counts == [1, 1, 1, 0]
    bm.check_invariants()


def test_fork_shares_only_live_blocks_and_cow_keeps_counts():
    bm = BlockManager(num_blocks=12, block_size=4, watermark=0, sliding_window=4)
    p = seq(0, 10)
    step(bm, p, 10)  # next position 10 reads 7..10 -> block 0 freed
    assert bm.get_block_table(p) == [F, 1, 2]
    c = p.fork(1, seed=0)
    bm.fork(p, c)
    assert bm.get_block_table(c) == [F, 1, 2]
    assert bm.allocator.ref_counts[:3] == [0, 2, 2]
    bm.check_invariants()
    # the next token of each lands in shared, partly filled block 2: the child copies it
    c.token_ids.append(7)
    copies = bm.allocate_slots(c, 1)
    assert copies == [(2, 3)]
    c.num_computed_tokens += 1
    bm.mark_computed(c)
    # next position 11 reads 8..11: the child drops its reference to block 1 (4..7)
    assert bm.get_block_table(c) == [F, F, 3]
    assert bm.allocator.ref_counts[:4] == [0, 1, 1, 1]  # block 2: the parent's only
    bm.check_invariants()
    decode(bm, p)  # the parent's copy of its last block is block 2 itself (now unshared)
    assert bm.get_block_table(p) == [F, F, 2]
    assert bm.allocator.ref_counts[:4] == [0, 0, 1, 1]
    for _ in range(4):  # positions 11..14: next (15) reads 12..15 -> blocks 2, 3 (8..11) freed
        decode(bm, p)
        decode(bm, c)
    assert bm.get_block_table(p)[:3] == [F, F, F] and bm.get_block_table(c)[:3] == [F, F, F]
    assert bm.allocator.ref_counts[:4] == [0, 0, 0, 0]
    free_all(bm, p, c)


def test_swap_moves_only_live_blocks():
    bm = BlockManager(num_blocks=8, block_size=4, watermark=0, num_swap_blocks=4, sliding_window=4)
    s = seq(0, 14)
    step(bm, s, 14)  # next position 14 reads 11..14 -> blocks 0, 1 freed
    assert bm.get_block_table(s) == [F, F, 2, 3]
    assert bm.can_swap_out([s])
    moved = bm.swap_out([s])
    assert moved == [(2, 0), (3, 1)]
    assert bm.swapped_tables[s.seq_id] == [F, F, 0, 1]
    assert bm.num_free_blocks == 8
    bm.check_invariants()
    assert bm.can_swap_in([s])
    back = bm.swap_in([s])
    assert [h for h, _ in back] == [0, 1]
    table = bm.get_block_table(s)
    assert table[:2] == [F, F] and all(b >= 0 for b in table[2:])
    assert bm.swap_ref_counts() == [0, 0, 0, 0]
    decode(bm, s)
    free_all(bm, s)


def test_recompute_after_free_reallocates_the_whole_sequence_then_trims():
    bm = BlockManager(num_blocks=8, block_size=4, watermark=0, sliding_window=4)
    s = seq(0, 14)
    step(bm, s, 14)
    bm.free(s)
    s.reset_for_recompute()
    s.num_computed_tokens = bm.allocate_prefix(s)  # cached blocks 0..1 are behind the window
    assert bm.get_block_table(s)[:2] == [F, F]
    step(bm, s, s.num_uncomputed_tokens)
    assert bm.num_live_blocks(s) == 2
    free_all(bm, s)


def test_chunked_prefill_keeps_the_window_before_each_chunk():
    bm = BlockManager(num_blocks=10, block_size=4, watermark=0, sliding_window=6)
    s = seq(0, 24)
    step(bm, s, 8)  # next chunk starts at 8 and reads from 3: block 0 (0..3) stays
    assert bm.get_block_table(s) == [0, 1]
    step(bm, s, 8)  # next position 16 reads 11..16: blocks 0, 1 (0..7) freed, 2 (8..11) kept
    assert bm.get_block_table(s) == [F, F, 2, 3]
    step(bm, s, 8)
    assert bm.get_block_table(s) == [F, F, F, F, 4, 5]


def test_windowed_requests_fit_by_their_window_not_their_length():
    bm = BlockManager(num_blocks=6, block_size=16, sliding_window=32)
    bm.check_request_fits(prompt_len=40, max_tokens=5000, num_samples=1, use_beam_search=False)
    full = BlockManager(num_blocks=6, block_size=16)
    with pytest.raises(ValueError, match="max_tokens"):
        full.check_request_fits(prompt_len=40, max_tokens=5000, num_samples=1, use_beam_search=False)
