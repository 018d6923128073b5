"""Physical KV blocks: a free list and reference counts (paper section 4.2, 4.4).

Pure bookkeeping on integers; the KV tensors themselves live in the worker's cache engine.
"""

from __future__ import annotations

from collections import OrderedDict


class NoFreeBlocksError(RuntimeError):
    """Raised by ``allocate`` when the pool is empty; callers check ``num_free`` first."""


class BlockAllocator:
    """A pool of ``num_blocks`` physical block ids with reference counts.

    The free list is kept in order: blocks are taken from its front and returned to its back, so
    the block freed longest ago is reused first (the LRU order that prefix caching relies on).
    All operations are O(1).

    Args:
        num_blocks: number of physical blocks in the pool (ids ``0 .. num_blocks - 1``).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # OrderedDict as an ordered set: O(1) pop from the front, append and removal anywhere.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free(self) -> int:
        """Blocks with reference count 0."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks with a reference count above 0."""
        return self.num_blocks - len(self._free)

    def free_block_ids(self) -> list[int]:
        """Free block ids in reuse order (next to be allocated first)."""
        return list(self._free)

    def allocate(self) -> int:
        """Take the front free block and give it reference count 1.

        Raises:
            NoFreeBlocksError: when no block is free.
        """
        if not self._free:
            raise NoFreeBlocksError("no free KV cache blocks")
        block_id, _ = self._free.popitem(last=False)
        self.ref_counts[block_id] = 1
        return block_id

    def take(self, block_id: int) -> None:
        """Take a specific free block (a prefix-cache hit on an evictable block); ref count 1.

        Raises:
            ValueError: when the block is not free.
        """
        if block_id not in self._free:
            raise ValueError(f"block {block_id} is not free")
        del self._free[block_id]
        self.ref_counts[block_id] = 1

    def incref(self, block_id: int) -> int:
        """Add an owner to an allocated block (fork / sharing); returns the new count."""
        if self.ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is free; cannot add a reference")
        self.ref_counts[block_id] += 1
        return self.ref_counts[block_id]

    def free(self, block_id: int) -> int:
        """Drop one owner; at zero the block returns to the back of the free list.

        Returns:
            the new reference count.

        Raises:
            ValueError: when the block is already free (a double free).
        """
        if self.ref_counts[block_id] <= 0:
            raise ValueError(f"double free of block {block_id}")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self._free[block_id] = None
        return self.ref_counts[block_id]

    def is_free(self, block_id: int) -> bool:
        """Whether ``block_id`` is in the free list."""
        return block_id in self._free
