"""Block tables: the logical -> physical block map of every sequence (paper section 4.2, figure 6).

A sequence's logical block ``i`` holds its tokens ``i * block_size .. (i + 1) * block_size - 1``;
``block_tables[seq_id][i]`` is the physical block holding them. A new physical block is taken only
when the last one is full, so at most ``block_size - 1`` slots per sequence are ever unused.
"""

from __future__ import annotations

from collections import Counter

from pagedllm.core.block_allocator import BlockAllocator, NoFreeBlocksError
from pagedllm.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Owns the physical block pool and every sequence's block table.

    Args:
        num_blocks: physical blocks in the pool.
        block_size: tokens per block.
        watermark: fraction of the pool kept free when admitting a *new* sequence, so that
            running sequences can still grow for a while without immediate preemption.
    """

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.allocator = BlockAllocator(num_blocks)
        self.watermark_blocks = int(watermark * num_blocks)
        self.block_tables: dict[int, list[int]] = {}

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.allocator.num_used

    def usage(self) -> float:
        """Fraction of the pool in use, 0..1."""
        return self.allocator.num_used / self.num_blocks

    def get_block_table(self, seq: Sequence) -> list[int]:
        return self.block_tables.get(seq.seq_id, [])

    def num_new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so the table covers ``num_computed_tokens + num_new_tokens`` tokens."""
        have = len(self.block_tables.get(seq.seq_id, ()))
        return max(0, cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - have)

    def can_allocate(self, seqs: list[Sequence], num_new_tokens: int) -> bool:
        """Whether a waiting group (no blocks yet) can be admitted, keeping the watermark free."""
        need = sum(self.num_new_blocks_needed(s, num_new_tokens) for s in seqs)
        return self.allocator.num_free - need >= self.watermark_blocks

    def can_append_slots(self, seqs: list[Sequence], num_new_tokens: int) -> bool:
        """Whether running sequences can each grow by ``num_new_tokens`` (no watermark)."""
        need = sum(self.num_new_blocks_needed(s, num_new_tokens) for s in seqs)
        return need <= self.allocator.num_free

    # ---- mutations -----------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Extend ``seq``'s block table to hold ``num_new_tokens`` more tokens.

        Returns:
            the physical block ids appended (possibly none).

        Raises:
            NoFreeBlocksError: if the pool runs out; check ``can_append_slots`` first. Nothing is
                allocated in that case.
        """
        need = self.num_new_blocks_needed(seq, num_new_tokens)
        if need > self.allocator.num_free:
            raise NoFreeBlocksError(f"need {need} blocks, {self.allocator.num_free} free")
        table = self.block_tables.setdefault(seq.seq_id, [])
        new = [self.allocator.allocate() for _ in range(need)]
        table.extend(new)
        return new

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``. Blocks go back tail first, so that later prefix caching
        evicts a sequence's tail before its (more shareable) head."""
        table = self.block_tables.pop(seq.seq_id, None)
        if not table:
            return
        for block_id in reversed(table):
            self.allocator.free(block_id)

    # ---- checks --------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert the pool is consistent: every block is either free with reference count 0, or
        owned with reference count equal to the number of block-table entries pointing at it.

        Raises:
            AssertionError: describing the first violation found.
        """
        owners: Counter[int] = Counter()
        for table in self.block_tables.values():
            owners.update(table)
        free = self.allocator.free_block_ids()
        assert len(free) == len(set(free)), "a block is in the free list twice"
        for b in range(self.num_blocks):
            rc = self.allocator.ref_counts[b]
            if self.allocator.is_free(b):
                assert rc == 0, f"free block {b} has ref count {rc}"
                assert owners[b] == 0, f"free block {b} is in a block table"
            else:
                assert rc == owners[b], f"block {b}: ref count {rc} != {owners[b]} owners"
                assert rc > 0, f"block {b} is neither free nor owned"
