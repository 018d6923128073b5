"""Orca baselines: exact reservations (max / pow2 / oracle), contiguous tables, waste numbers."""

import pytest

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.contiguous_kv_manager import ContiguousKVManager, next_pow2
from pagedllm.core.kv_waste import contiguous_waste, paged_waste
from pagedllm.sequence import Sequence


def seq(seq_id: int, prompt_len: int, max_tokens: int) -> Sequence:
    s = Sequence(seq_id, list(range(prompt_len)), seed=0)
    s.max_num_tokens = prompt_len + max_tokens
    return s


def test_next_pow2():
    assert [next_pow2(n) for n in (1, 2, 3, 17, 64, 65)] == [1, 2, 4, 32, 64, 128]


@pytest.mark.parametrize(
    "policy, tokens, blocks, chunk",
    [
        ("orca-max", 128, 32, 32),  # max_model_len = 128 slots
        ("orca-pow2", 64, 16, 16),  # 10 + 30 = 40 -> 64
        ("orca-oracle", 40, 10, 16),  # exactly 40 slots = 10 blocks -> buddy chunk 16
    ],
)
def test_reservation_sizes(policy, tokens, blocks, chunk):
    m = ContiguousKVManager(64, 4, policy, max_model_len=128)
    s = seq(0, 10, 30)
    assert m.reservation_tokens(s) == tokens
    assert m.reservation_blocks(s) == blocks
    assert m.can_allocate([s])
    assert m.allocate_prefix(s) == 0
    assert m.block_tables[0] == list(range(0, blocks))
    assert m.reserved_chunk_blocks(s) == chunk
    assert m.num_free_blocks == 64 - chunk
    m.check_invariants()
    m.free(s)
    assert m.num_free_blocks == 64
    m.check_invariants()


def test_pow2_is_capped_at_max_model_len():
    m = ContiguousKVManager(64, 4, "orca-pow2", max_model_len=100)
    assert m.reservation_tokens(seq(0, 50, 30)) == 100  # next pow2 of 80 = 128 > 100


def test_orca_max_larger_than_pool_is_refused():
    with pytest.raises(ValueError, match="max_model_len"):
        ContiguousKVManager(12, 4, "orca-max", max_model_len=64)  # 16 blocks > root of 8


def test_table_grows_with_scheduled_work_and_never_needs_blocks():
    m = ContiguousKVManager(16, 4, "orca-oracle", max_model_len=64)
    s = seq(0, 6, 4)  # 10 tokens -> 3 blocks -> chunk 4
    m.allocate_prefix(s)
    assert m.num_new_blocks_needed(s, 6) == 0
    assert m.allocate_slots(s, 6) == []
    assert m.get_block_table(s) == [0, 1]
    s.num_computed_tokens = 6
    s.token_ids.append(7)
    m.allocate_slots(s, 1)
    assert m.get_block_table(s) == [0, 1]
    s.num_computed_tokens = 9
    m.allocate_slots(s, 1)
    assert m.get_block_table(s) == [0, 1, 2]
    m.free(s)


def test_contiguous_waste_exact_numbers():
    # Pool 16 blocks x 4 slots. orca-max with max_model_len 32 -> 8 blocks per request.
    m = ContiguousKVManager(16, 4, "orca-max", max_model_len=32)
    a = seq(0, 5, 5)  # true length 10
    m.allocate_prefix(a)
    a.num_computed_tokens = 6
    w = contiguous_waste(m, [a], None)
    assert (w.token_states, w.reserved, w.internal_fragmentation, w.external_fragmentation) == (
        6,
        4,
        32 - 10,
        0,
    )
    # orca-oracle: 10 tokens -> 3 blocks -> chunk of 4 blocks: 1 block (4 slots) of rounding
    # (external), 12 - 10 = 2 slots of internal fragmentation.
    o = ContiguousKVManager(16, 4, "orca-oracle", max_model_len=64)
    b = seq(0, 5, 5)
    o.allocate_prefix(b)
    b.num_computed_tokens = 5
    w = contiguous_waste(o, [b], None)
    assert (w.token_states, w.reserved, w.internal_fragmentation, w.external_fragmentation) == (
        5,
        5,
        2,
        4,
    )


def test_stranded_free_memory_counts_as_external_fragmentation():
    o = ContiguousKVManager(16, 4, "orca-oracle", max_model_len=64)
    x, y = seq(0, 4, 0), seq(1, 4, 0)  # 4 tokens -> 1 block each... use 4-block chunks:
    x.max_num_tokens = y.max_num_tokens = 16
    z = seq(2, 4, 12)
    o.allocate_prefix(x)  # 0..3
    o.allocate_prefix(y)  # 4..7
    o.allocate_prefix(z)  # 8..11
    o.free(y)  # free: 4..7 and 12..15 (8 blocks, not one 8-block chunk)
    head = seq(3, 20, 12)  # 32 tokens -> 8 blocks
    assert not o.can_allocate([head])
    x.num_computed_tokens = z.num_computed_tokens = 4
    w = contiguous_waste(o, [x, z], head)
    assert w.external_fragmentation == 8 * 4  # all free slots stranded
    assert (w.token_states, w.reserved, w.internal_fragmentation) == (8, 24, 0)
    small = seq(4, 2, 2)  # fits a free chunk: nothing stranded
    assert contiguous_waste(o, [x, z], small).external_fragmentation == 0


def test_paged_waste_exact_numbers():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    s = seq(0, 6, 4)  # final length 10
    bm.allocate_slots(s, 6)  # 2 blocks: 8 slots
    s.num_computed_tokens = 6
    w = paged_waste(bm, [s])
    assert (w.token_states, w.reserved, w.internal_fragmentation, w.external_fragmentation) == (
        6,
        2,
        0,
        0,
    )
    s.token_ids += [1, 2, 3]
    bm.allocate_slots(s, 3)  # 9 tokens -> 3 blocks = 12 slots; final 10
    s.num_computed_tokens = 9
    w = paged_waste(bm, [s])
    assert (w.token_states, w.reserved, w.internal_fragmentation) == (9, 1, 2)


def test_paged_waste_counts_shared_blocks_once_beside_exclusive_tables():
    """A forked pair's shared blocks count once; an exclusive table beside them takes the
    whole-table path (all its blocks at reference count 1). Block size 4."""
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a, c = seq(0, 6, 4), seq(2, 3, 1)
    bm.allocate_slots(a, 6)  # blocks 0, 1
    bm.allocate_slots(c, 3)  # block 2
    a.num_computed_tokens, c.num_computed_tokens = 6, 3
    b = seq(1, 6, 4)
    bm.fork(a, b)
    b.num_computed_tokens = 6
    assert bm.allocator.ref_counts[:3] == [2, 2, 1]
    w = paged_waste(bm, [a, b, c])
    # held 6 (blocks 0-1, once) + 3 (block 2) = 9 of 12 slots; reserved min(2 + 2 + 1, 12 - 9) = 3
    assert (w.token_states, w.reserved, w.internal_fragmentation) == (9, 3, 0)
    w = paged_waste(bm, [c])  # c alone: 3 held, 1 reserved, the rest of the 12 is unaccounted
    assert (w.token_states, w.reserved, w.internal_fragmentation) == (3, 1, 8)
