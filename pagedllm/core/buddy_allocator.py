"""A buddy allocator over the KV block pool: contiguous runs of physical blocks.

The contiguous-cache baselines (the paper's re-implemented Orca, section 6.1) give each request
one contiguous run of KV slots. Over a pool of blocks, a contiguous run is a chunk of consecutive
block ids, so the block table of such a request is ``start, start + 1, ...`` and the same paged
kernels read it. Chunks come from a binary buddy system (Knowlton 1965): every chunk has a
power-of-two size ``2**order`` blocks and starts at a multiple of its size; a request for ``n``
blocks takes a chunk of ``2**ceil(log2 n)`` blocks, splitting larger chunks in halves ("buddies")
as needed, and a freed chunk merges with its buddy whenever the buddy is free too.

A pool whose size is not a power of two is covered by its largest aligned power-of-two "root"
chunks (100 blocks = 64 + 32 + 4); chunks never merge across roots.

Pure bookkeeping on integers (block ids), like ``block_allocator``.
"""

from __future__ import annotations

from pagedllm.core.block_allocator import NoFreeBlocksError


def order_for(num_blocks: int) -> int:
    """Smallest ``k`` with ``2**k >= num_blocks`` (the order of the chunk that serves it).

    Raises:
        ValueError: naming ``num_blocks`` when it is < 1.
    """
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    return (num_blocks - 1).bit_length()


class BuddyAllocator:
    """Power-of-two chunks of consecutive block ids over a pool of ``num_blocks`` blocks.

    Allocation takes the lowest-addressed free chunk of the smallest sufficient order (so the
    resulting block ids are deterministic), splitting it down and keeping the upper halves free.

    Args:
        num_blocks: blocks in the pool (ids ``0 .. num_blocks - 1``).

    Raises:
        ValueError: naming ``num_blocks`` when it is < 1.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        # free_chunks[k] = start ids of free chunks of 2**k blocks.
        self.max_order = num_blocks.bit_length() - 1
        self.free_chunks: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        self._allocated: dict[int, int] = {}  # chunk start -> order
        self._root_of: dict[int, tuple[int, int]] = {}  # root start -> (start, order)
        self._roots: list[tuple[int, int]] = []
        start = 0
        for k in range(self.max_order, -1, -1):
            if num_blocks & (1 << k):
                self._roots.append((start, k))
                self.free_chunks[k].add(start)
                start += 1 << k
        self._num_free = num_blocks

    # ---- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Free blocks, counting every free chunk whole."""
        return self._num_free

    @property
    def num_used(self) -> int:
        """Blocks inside allocated chunks."""
        return self.num_blocks - self._num_free

    @property
    def max_chunk_blocks(self) -> int:
        """The largest chunk the empty pool can ever give (its largest root), in blocks."""
        return 1 << self._roots[0][1]

    def largest_free_chunk(self) -> int:
        """Blocks in the largest free chunk now (0 when the pool is full)."""
        for k in range(self.max_order, -1, -1):
            if self.free_chunks[k]:
                return 1 << k
        return 0

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether a chunk of at least ``num_blocks`` blocks is free now."""
        return self.largest_free_chunk() >= (1 << order_for(num_blocks))

    def is_free(self, block_id: int) -> bool:
        """Whether ``block_id`` lies in a free chunk."""
        return any((block_id >> k << k) in starts for k, starts in enumerate(self.free_chunks))

    def free_block_ids(self) -> list[int]:
        """Every free block id, ascending."""
        return sorted(
            s + i
            for k, starts in enumerate(self.free_chunks)
            for s in starts
            for i in range(1 << k)
        )

    @property
    def ref_counts(self) -> list[int]:
        """1 for a block inside an allocated chunk, 0 otherwise (for the KV dashboard)."""
        rc = [0] * self.num_blocks
        for start, k in self._allocated.items():
            for b in range(start, start + (1 << k)):
                rc[b] = 1
        return rc

    def allocated_chunks(self) -> dict[int, int]:
        """Allocated chunk start -> size in blocks."""
        return {s: 1 << k for s, k in self._allocated.items()}

    # ---- mutations -------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> tuple[int, int]:
        """Take a chunk of ``2**ceil(log2 num_blocks)`` consecutive blocks.

        Returns:
            (first block id, chunk size in blocks).

        Raises:
            ValueError: naming ``num_blocks`` when it is < 1 or larger than any root chunk.
            NoFreeBlocksError: when no free chunk is large enough (the pool may still have that
                many free blocks in smaller pieces: external fragmentation).
        """
        want = order_for(num_blocks)
        if (1 << want) > self.max_chunk_blocks:
            raise ValueError(
                f"num_blocks ({num_blocks}) exceeds the largest chunk of the pool "
                f"({self.max_chunk_blocks} blocks)"
            )
        k = next((k for k in range(want, self.max_order + 1) if self.free_chunks[k]), None)
        if k is None:
            raise NoFreeBlocksError(
                f"no free chunk of {1 << want} blocks ({self._num_free} blocks free in pieces)"
            )
        start = min(self.free_chunks[k])
        self.free_chunks[k].remove(start)
        while k > want:  # split: keep the lower half, free the upper buddy
            k -= 1
            self.free_chunks[k].add(start + (1 << k))
        self._allocated[start] = want
        self._num_free -= 1 << want
        return start, 1 << want

    def free(self, start: int) -> None:
        """Return the chunk starting at ``start``, merging it with free buddies.

        Raises:
            ValueError: naming ``start`` when no allocated chunk starts there (a double free).
        """
        k = self._allocated.pop(start, None)
        if k is None:
            raise ValueError(f"start: no allocated chunk starts at block {start}")
        self._num_free += 1 << k
        root_start, root_order = self._root_containing(start)
        while k < root_order:
            buddy = root_start + ((start - root_start) ^ (1 << k))
            if buddy not in self.free_chunks[k]:
                break
            self.free_chunks[k].remove(buddy)
            start = min(start, buddy)
            k += 1
        self.free_chunks[k].add(start)

    def _root_containing(self, block_id: int) -> tuple[int, int]:
        for start, k in self._roots:
            if start <= block_id < start + (1 << k):
                return start, k
        raise ValueError(f"block {block_id} is outside the pool of {self.num_blocks} blocks")

    def check_invariants(self) -> None:
        """Assert free and allocated chunks tile the pool exactly, aligned within their roots,
        and no two free buddies were left unmerged.

        Raises:
            AssertionError: describing the first violation.
        """
        cover = [0] * self.num_blocks
        chunks = [(s, k) for k, starts in enumerate(self.free_chunks) for s in starts]
        chunks += list(self._allocated.items())
        for s, k in chunks:
            rs, _ = self._root_containing(s)
            assert (s - rs) % (1 << k) == 0, f"chunk at {s} of order {k} is misaligned"
            for b in range(s, s + (1 << k)):
                cover[b] += 1
        assert all(c == 1 for c in cover), "chunks do not tile the pool exactly once"
        assert self._num_free == sum(len(st) << k for k, st in enumerate(self.free_chunks))
        for k, starts in enumerate(self.free_chunks):
            for s in starts:
                rs, ro = self._root_containing(s)
                if k < ro:
                    buddy = rs + ((s - rs) ^ (1 << k))
                    assert buddy not in starts, f"free buddies {s} and {buddy} left unmerged"
