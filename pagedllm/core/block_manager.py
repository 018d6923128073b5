"""Block tables: the logical -> physical block map of every sequence (paper section 4.2, figure 6),
with sharing by reference count (section 4.4): fork, copy-on-write and prefix caching.

A sequence's logical block ``i`` holds its tokens ``i * block_size .. (i + 1) * block_size - 1``;
``block_tables[seq_id][i]`` is the physical block holding them. A new physical block is taken only
when the last one is full, so at most ``block_size - 1`` slots per sequence are ever unused.

Sliding window (``sliding_window``, a model whose layers all attend to their last ``W``
positions, Mistral-style): a block whose every position is below ``next position - W + 1`` is
never read again, so it goes back to the pool while the request runs and its table entry becomes
``FREED_BLOCK``. Freed entries always form a prefix of the table; the table keeps its length, so
positions and slot mapping are unchanged. A sequence then holds at most ``ceil(W / block_size) +
1`` blocks while it decodes (a whole-prompt prefill still needs the prompt's blocks at once).
"""

from __future__ import annotations

from collections import Counter

from pagedllm.core.block_allocator import BlockAllocator, NoFreeBlocksError
from pagedllm.core.kv_manager import FREED_BLOCK, cdiv, check_pool_fits, rollback_computed
from pagedllm.core.kv_waste import KVWaste, paged_waste
from pagedllm.core.prefix_cache import PrefixCache, hash_block
from pagedllm.sequence import Sequence

__all__ = ["FREED_BLOCK", "BlockManager", "cdiv"]


class BlockManager:
    """Owns the physical block pool, every sequence's block table and the prefix cache.

    The paged implementation of ``core.kv_manager.KVManager``.

    Args:
        num_blocks: physical blocks in the pool.
        block_size: tokens per block.
        watermark: fraction of the pool kept free when admitting a *new* sequence, so that
            running sequences can still grow for a while without immediate preemption.
        enable_prefix_caching: keep full blocks findable by content after their owners finish.
        num_swap_blocks: blocks of host swap space for preemption by swapping (0 = none).
        sliding_window: tokens every layer attends to (its own included), when all layers are
            windowed; blocks wholly before the window are freed while the sequence runs. None:
            keep every block (full attention, or a mix of local and global layers).

    Raises:
        ValueError: naming ``sliding_window`` when it is below 1.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        watermark: float = 0.01,
        enable_prefix_caching: bool = True,
        num_swap_blocks: int = 0,
        sliding_window: int | None = None,
    ) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.sliding_window = sliding_window
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.allocator = BlockAllocator(num_blocks)
        # Host swap space: a second, separate pool; swapped-out sequences' tables point into it.
        self.num_swap_blocks = num_swap_blocks
        self.swap_allocator = BlockAllocator(num_swap_blocks) if num_swap_blocks else None
        self.swapped_tables: dict[int, list[int]] = {}
        self.watermark_blocks = int(watermark * num_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.prefix_cache: PrefixCache | None = PrefixCache() if enable_prefix_caching else None

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks not owned by any sequence (cached-but-evictable ones included)."""
        return self.allocator.num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks owned by at least one sequence (a shared block counts once)."""
        return self.allocator.num_used

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks still holding a cached prefix (reusable until evicted)."""
        if self.prefix_cache is None:
            return 0
        return sum(1 for b in self.prefix_cache.key_of if self.allocator.is_free(b))

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix whose block no sequence holds (vLLM's ``reset_prefix_cache``).

        Blocks owned by running or swapped-out sequences keep their keys, so sharing among live
        requests goes on. Used between benchmark rounds so a repeated workload starts cold.

        Returns:
            Number of blocks whose key was dropped (0 without prefix caching).
        """
        if self.prefix_cache is None:
            return 0
        free_cached = [b for b in self.prefix_cache.key_of if self.allocator.is_free(b)]
        for b in free_cached:
            self.prefix_cache.evict(b)
        return len(free_cached)

    def usage(self) -> float:
        """Fraction of the pool owned by sequences, 0..1."""
        return self.allocator.num_used / self.num_blocks

    def ref_counts(self) -> list[int]:
        """A copy of every device block's reference count (index = block id)."""
        return list(self.allocator.ref_counts)

    def swap_ref_counts(self) -> list[int] | None:
        """A copy of every host swap block's reference count; None without swap space."""
        return list(self.swap_allocator.ref_counts) if self.swap_allocator is not None else None

    def get_block_table(self, seq: Sequence) -> list[int]:
        """``seq``'s physical block ids, logical order ([] when it holds none)."""
        return self.block_tables.get(seq.seq_id, [])

    def check_request_fits(
        self, prompt_len: int, max_tokens: int, num_samples: int, use_beam_search: bool,
        samples_field: str = "n",
    ) -> None:
        """Refuse a request that could never make progress in the whole pool
        (``core.kv_manager.check_pool_fits``); beams count as samples and must all fit at
        their longest (a beam search is never finished by length for lack of blocks).

        Raises:
            ContextLengthExceededError: (param "max_tokens" or ``samples_field``) naming the
                pool size.
        """
        min_output = max_tokens if use_beam_search else 1
        if self.sliding_window is not None:
            # A windowed sequence never holds more than its prompt's blocks or its window's,
            # whatever its length: bound the output tokens that must fit at once.
            max_tokens = min(max_tokens, self.sliding_window + self.block_size)
            min_output = min(min_output, max_tokens)
        check_pool_fits(
            self.num_blocks, self.block_size, prompt_len, max_tokens, num_samples, samples_field,
            min_output,
        )

    def waste(self, holders: list[Sequence], waiting_head: Sequence | None) -> KVWaste:
        """The figure 2 breakdown (``core.kv_waste.paged_waste``); no external fragmentation,
        so ``waiting_head`` is not needed."""
        return paged_waste(self, holders)

    def _needs_cow(self, table: list[int], num_computed: int) -> bool:
        """The next token lands in a partly filled block that other sequences share."""
        if num_computed % self.block_size == 0:
            return False
        idx = num_computed // self.block_size
        return idx < len(table) and self.allocator.ref_counts[table[idx]] > 1

    def num_new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to take so the table covers ``num_computed_tokens + num_new_tokens`` tokens,
        counting a copy-on-write of a shared last block."""
        table = self.block_tables.get(seq.seq_id, [])
        grow = max(0, cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(table))
        return grow + int(self._needs_cow(table, seq.num_computed_tokens))

    def num_blocks_needed(self, plan: list[tuple[Sequence, int]]) -> int:
        """Blocks that ``allocate_slots`` takes for every (sequence, new tokens) of ``plan``, in
        order: growth plus copy-on-writes. A shared, partly filled last block held by ``r``
        sequences costs at most ``r - 1`` copies: each writer before the last copies it and drops
        a reference, and the last finds itself the only owner and writes in place (paper
        section 4.4). Summing ``num_new_blocks_needed`` would count ``r`` and cap a parallel
        sampling or beam search group one block early."""
        grow = 0
        writers: Counter[int] = Counter()  # shared last block -> holders writing it this step
        for seq, n in plan:
            table = self.block_tables.get(seq.seq_id, [])
            grow += max(0, cdiv(seq.num_computed_tokens + n, self.block_size) - len(table))
            if self._needs_cow(table, seq.num_computed_tokens):
                writers[table[seq.num_computed_tokens // self.block_size]] += 1
        refs = self.allocator.ref_counts
        return grow + sum(min(h, refs[block] - 1) for block, h in writers.items())

    def can_append_slots(self, seqs: list[Sequence], num_new_tokens: int) -> bool:
        """Whether running sequences can each grow by ``num_new_tokens`` (no watermark)."""
        return self.num_blocks_needed([(s, num_new_tokens) for s in seqs]) <= self.allocator.num_free

    # ---- admission with prefix caching -----------------------------------------------------
    def cached_prefix_blocks(self, seq: Sequence) -> list[int]:
        """Physical blocks holding the longest cached prefix of ``seq`` (a sequence with no
        blocks yet). At most ``(num_tokens - 1) // block_size`` blocks, so that at least the last
        token is computed (its logits are needed) and never into a shared block; none when
        ``seq.use_cached_prefix`` is False (its prompt logprobs need every position computed)."""
        if self.prefix_cache is None or not seq.use_cached_prefix:
            return []
        self._extend_hashes(seq, (seq.num_tokens - 1) // self.block_size)
        hits: list[int] = []
        for key in seq.block_hashes[: (seq.num_tokens - 1) // self.block_size]:
            block = self.prefix_cache.lookup(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def group_shared_blocks(self, seqs: list[Sequence]) -> int:
        """Full prompt blocks the sequences of a group being readmitted (after preemption by
        recompute) can share: the first sequence computes them, the others point at them in the
        same step, so a recomputed group needs no more memory than it had (paper figure 8)."""
        if len(seqs) < 2:
            return 0
        k = seqs[0].num_prompt_tokens // self.block_size
        return min([k] + [(s.num_tokens - 1) // self.block_size for s in seqs[1:]])

    def can_allocate(self, seqs: list[Sequence], watermark: bool = True) -> bool:
        """Whether waiting sequences (no blocks yet) can be admitted now, keeping the watermark.

        Args:
            seqs: the group's sequences (the first one leads: see ``group_shared_blocks``).
            watermark: keep ``watermark_blocks`` free (False when nothing else runs, so a
                request that needs the whole pool is still admitted).
        """
        shared = self.group_shared_blocks(seqs)
        need = 0
        taken: set[int] = set()  # free cached blocks a sequence before took out of the free list
        for i, s in enumerate(seqs):
            hits = self.cached_prefix_blocks(s)
            have = len(hits) if i == 0 or len(hits) >= shared else shared
            need += cdiv(s.num_tokens, self.block_size) - have
            if have == len(hits):
                # A hit on a free (evictable) block takes it out of the free list too, once:
                # the group's later sequences hitting it only add a reference. (Counting it
                # per sequence made a readmitted n = 3 group need 15 of 10 blocks for good.)
                fresh = {b for b in hits if self.allocator.is_free(b)} - taken
                need += len(fresh)
                taken |= fresh
        return self.allocator.num_free - need >= (self.watermark_blocks if watermark else 0)

    def first_chunk_room(self, seqs: list[Sequence]) -> int:
        """New blocks the first chunk of a waiting group's lead may take now, for a group
        admitted on that chunk alone (``core.scheduler``: chunked prefill, the pool to itself):
        with a sliding window a sequence holds only its window's blocks and its chunk's, so
        the whole sequences ``can_allocate`` counts need not fit at once.

        Args:
            seqs: the group's sequences (the first one leads; the others wait for it).

        Returns:
            The free blocks less the free cached blocks the lead's cached prefix takes
            (``allocate_prefix``: those in its window); 0 without a sliding window.
        """
        if self.sliding_window is None:
            return 0
        hits = self.cached_prefix_blocks(seqs[0])
        live = hits[self._first_live_block(len(hits) * self.block_size) :]
        taken = sum(1 for b in live if self.allocator.is_free(b))
        return max(0, self.allocator.num_free - taken)

    def can_share_prefix(self, lead: Sequence, num_blocks: int) -> bool:
        """Whether ``lead`` still holds each of its first ``num_blocks`` blocks that a sequence
        going on from them reads (with a sliding window, the lead may have freed some of those
        while computing past them)."""
        table = self.block_tables.get(lead.seq_id, [])[:num_blocks]
        live = table[self._first_live_block(num_blocks * self.block_size) :]
        return len(table) == num_blocks and FREED_BLOCK not in live

    def share_prefix(self, lead: Sequence, other: Sequence, num_blocks: int) -> int:
        """Point ``other`` (no blocks yet) at ``lead``'s first ``num_blocks`` blocks; returns the
        tokens they hold (``other``'s new ``num_computed_tokens``)."""
        table = self.block_tables[lead.seq_id][:num_blocks]
        # With a window, the lead's freed entries (cache hits behind its own window, see
        # allocate_prefix) never reach into the other's window: ``other`` is only shared with
        # when its own cache hits are fewer than ``num_blocks``, so the lead's hits are fewer
        # too (same prompt, same hash chain) and its window starts no later than the other's.
        assert FREED_BLOCK not in table[self._first_live_block(num_blocks * self.block_size) :]
        self._incref_live(table)
        self.block_tables[other.seq_id] = list(table)
        self._release_before(other.seq_id, num_blocks * self.block_size)
        return num_blocks * self.block_size

    def allocate_prefix(self, seq: Sequence) -> int:
        """Give a waiting sequence its cached prefix blocks; returns the cached tokens (its new
        ``num_computed_tokens``)."""
        hits = self.cached_prefix_blocks(seq)
        if self.prefix_cache is not None and seq.use_cached_prefix:
            self.prefix_cache.queries += max(1, (seq.num_tokens - 1) // self.block_size)
            self.prefix_cache.hits += len(hits)
        # Hits wholly before the window of the first token to compute are not taken.
        first_live = self._first_live_block(len(hits) * self.block_size)
        for b in hits[first_live:]:
            if self.allocator.is_free(b):
                self.allocator.take(b)
            else:
                self.allocator.incref(b)
        self.block_tables[seq.seq_id] = [FREED_BLOCK] * first_live + hits[first_live:]
        return len(hits) * self.block_size

    # ---- mutations -----------------------------------------------------------------------
    def _take_block(self) -> int:
        block = self.allocator.allocate()
        if self.prefix_cache is not None:
            self.prefix_cache.evict(block)  # its old prefix is about to be overwritten
        return block

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Extend ``seq``'s block table to hold ``num_new_tokens`` more tokens.

        If the next token lands in a shared, partly filled block, that block is copied first
        (copy-on-write, paper figure 8): a new block replaces it in this table and the old one
        loses a reference.

        Returns:
            (source, destination) block pairs the worker must copy before the forward pass.

        Raises:
            NoFreeBlocksError: if the pool runs out; check ``can_append_slots`` first. Nothing is
                changed in that case.
        """
        need = self.num_new_blocks_needed(seq, num_new_tokens)
        if need > self.allocator.num_free:
            raise NoFreeBlocksError(f"need {need} blocks, {self.allocator.num_free} free")
        table = self.block_tables.setdefault(seq.seq_id, [])
        copies: list[tuple[int, int]] = []
        if self._needs_cow(table, seq.num_computed_tokens):
            idx = seq.num_computed_tokens // self.block_size
            src, dst = table[idx], self._take_block()
            self.allocator.free(src)
            table[idx] = dst
            copies.append((src, dst))
        grow = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(table)
        table.extend(self._take_block() for _ in range(grow))
        return copies

    def rollback_slots(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Take back the slots of ``seq``'s last ``num_tokens`` computed tokens (speculative
        tokens the target rejected): ``num_computed_tokens`` drops by ``num_tokens`` and the
        blocks past the last kept token return to the pool (newest first). Call it before
        ``mark_computed``, so no block holding a rejected token is registered in the prefix cache.

        Returns:
            The freed block ids, in the order they were freed.

        Raises:
            ValueError: naming ``num_tokens`` when negative or more than the tokens computed.
        """
        rollback_computed(seq, num_tokens)
        table = self.block_tables.get(seq.seq_id, [])
        keep = cdiv(seq.num_computed_tokens, self.block_size)
        freed = table[keep:][::-1]
        del table[keep:]
        for block in freed:
            self.allocator.free(block)  # new blocks of this step: never registered nor shared
        return freed

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (reference counts + 1); paper figure 8."""
        table = self.block_tables.get(parent.seq_id, [])
        self._incref_live(table)
        self.block_tables[child.seq_id] = list(table)
        child.block_hashes = list(parent.block_hashes)

    def mark_computed(self, seq: Sequence) -> None:
        """Register the blocks that became full (all their tokens computed) in the prefix cache,
        then, with a sliding window, free the blocks the next token's window no longer covers
        (registered first, so a freed block stays findable by its prefix until reused)."""
        self._register_full_blocks(seq)
        self._release_before(seq.seq_id, seq.num_computed_tokens)

    def _register_full_blocks(self, seq: Sequence) -> None:
        if self.prefix_cache is None:
            return
        full = seq.num_computed_tokens // self.block_size
        table = self.block_tables.get(seq.seq_id, [])
        start = seq.num_registered_blocks
        if full <= start:
            return
        self._extend_hashes(seq, full)
        for i in range(start, min(full, len(table))):
            if table[i] != FREED_BLOCK:
                self.prefix_cache.register(table[i], seq.block_hashes[i])
        seq.num_registered_blocks = full

    # ---- sliding window ------------------------------------------------------------------
    def _first_live_block(self, next_pos: int) -> int:
        """Logical index of the first block the query at ``next_pos`` (and every later one)
        still reads: blocks below it hold only positions < ``next_pos - window + 1``."""
        if self.sliding_window is None:
            return 0
        return max(0, next_pos - self.sliding_window + 1) // self.block_size

    def _release_before(self, seq_id: int, next_pos: int) -> int:
        """Free the blocks of ``seq_id`` wholly before the window of position ``next_pos``
        (the next token to compute); their entries become ``FREED_BLOCK``. Walks back from the
        window start to the already-freed prefix, so each block is visited once. Freed newest
        first, so the oldest (most shareable prefix) block is evicted last. Returns the count."""
        table = self.block_tables.get(seq_id)
        if table is None or self.sliding_window is None:
            return 0
        n = 0
        for i in range(min(self._first_live_block(next_pos), len(table)) - 1, -1, -1):
            if table[i] == FREED_BLOCK:
                break
            self.allocator.free(table[i])
            table[i] = FREED_BLOCK
            n += 1
        return n

    def _incref_live(self, table: list[int]) -> None:
        for b in table:
            if b != FREED_BLOCK:
                self.allocator.incref(b)

    def num_live_blocks(self, seq: Sequence) -> int:
        """Device blocks ``seq``'s table holds now (its ``FREED_BLOCK`` entries excluded)."""
        table = self.block_tables.get(seq.seq_id, [])
        return len(table) - table.count(FREED_BLOCK)

    def _extend_hashes(self, seq: Sequence, num_blocks: int) -> None:
        bs = self.block_size
        hashes = seq.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(
                hash_block(
                    hashes[-1] if hashes else None,
                    seq.token_ids[i * bs : (i + 1) * bs],
                    seq.cache_salt,
                )
            )

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq`` (device or swap). Blocks go back tail first, so that
        the prefix cache evicts a sequence's tail before its (more shareable) head."""
        seq.num_registered_blocks = 0
        table = self.block_tables.pop(seq.seq_id, None)
        for block_id in reversed(table or []):
            if block_id != FREED_BLOCK:
                self.allocator.free(block_id)
        swapped = self.swapped_tables.pop(seq.seq_id, None)
        if swapped and self.swap_allocator is not None:
            for block_id in reversed(swapped):
                if block_id != FREED_BLOCK:
                    self.swap_allocator.free(block_id)

    # ---- swapping (paper section 4.5) -------------------------------------------------------
    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        """Whether the host pool can take every distinct block of the group."""
        if self.swap_allocator is None:
            return False
        distinct = {b for s in seqs for b in self.block_tables.get(s.seq_id, ())}
        distinct.discard(FREED_BLOCK)
        return len(distinct) <= self.swap_allocator.num_free

    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Move a group's blocks to the host pool; a block shared inside the group moves once,
        a freed (out-of-window) entry stays ``FREED_BLOCK`` and moves nothing.

        Returns:
            (device block, host block) pairs for the worker to copy before the step.
        """
        assert self.swap_allocator is not None
        mapping: dict[int, int] = {}
        for s in seqs:
            table = self.block_tables.pop(s.seq_id, [])
            host = []
            for b in table:
                if b == FREED_BLOCK:
                    host.append(FREED_BLOCK)
                    continue
                if b in mapping:
                    self.swap_allocator.incref(mapping[b])
                else:
                    mapping[b] = self.swap_allocator.allocate()
                host.append(mapping[b])
            self.swapped_tables[s.seq_id] = host
            for b in reversed(table):
                if b != FREED_BLOCK:
                    self.allocator.free(b)
            s.num_registered_blocks = 0  # new device blocks after swap-in get registered again
        return list(mapping.items())

    def can_swap_in(self, seqs: list[Sequence], reserve: bool = True) -> bool:
        """Whether the device pool can take the group back; with ``reserve``, also room for each
        sequence's next block and the watermark (False when nothing else runs)."""
        distinct = {b for s in seqs for b in self.swapped_tables.get(s.seq_id, ())}
        distinct.discard(FREED_BLOCK)
        extra = len(seqs) + self.watermark_blocks if reserve else 0
        return self.allocator.num_free - len(distinct) >= extra

    def swap_in(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Bring a swapped group's blocks back to the device pool (sharing preserved).

        Returns:
            (host block, device block) pairs for the worker to copy before the step.
        """
        assert self.swap_allocator is not None
        mapping: dict[int, int] = {}
        for s in seqs:
            host = self.swapped_tables.pop(s.seq_id, [])
            table = []
            for b in host:
                if b == FREED_BLOCK:
                    table.append(FREED_BLOCK)
                    continue
                if b in mapping:
                    self.allocator.incref(mapping[b])
                else:
                    mapping[b] = self._take_block()
                table.append(mapping[b])
            self.block_tables[s.seq_id] = table
            for b in reversed(host):
                if b != FREED_BLOCK:
                    self.swap_allocator.free(b)
        return list(mapping.items())

    # ---- checks --------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert the pool is consistent: every block is either free with reference count 0, or
        owned with reference count equal to the number of block-table entries pointing at it;
        the prefix cache's two maps agree; ``FREED_BLOCK`` entries only with a sliding window,
        and only as a prefix of a table (device or host).

        Raises:
            AssertionError: describing the first violation found.
        """
        owners: Counter[int] = Counter()
        for table in (*self.block_tables.values(), *self.swapped_tables.values()):
            freed = table.count(FREED_BLOCK)
            assert freed == 0 or self.sliding_window is not None, "freed entry without a window"
            assert table[:freed] == [FREED_BLOCK] * freed, "freed entries are not a prefix"
        for table in self.block_tables.values():
            owners.update(table)
        del owners[FREED_BLOCK]
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
        if self.swap_allocator is not None:
            swap_owners: Counter[int] = Counter()
            for table in self.swapped_tables.values():
                swap_owners.update(table)
            del swap_owners[FREED_BLOCK]
            for b in range(self.num_swap_blocks):
                rc = self.swap_allocator.ref_counts[b]
                assert rc == swap_owners[b], f"swap block {b}: ref count {rc} != {swap_owners[b]}"
                assert (rc == 0) == self.swap_allocator.is_free(b), f"swap block {b} free state"
        if self.prefix_cache is not None:
            pc = self.prefix_cache
            assert len(pc.block_of) == len(pc.key_of), "prefix cache maps disagree"
            for key, b in pc.block_of.items():
                assert pc.key_of.get(b) == key, f"prefix cache: block {b} key mismatch"
