"""Contiguous KV reservation: the paper's re-implemented Orca baselines (section 6.1).

Orca-style systems store each request's KV cache in one contiguous run of memory reserved when
the request is admitted, sized by what the system assumes about the request's final length:

- ``orca-max``: ``max_model_len`` slots for every request;
- ``orca-pow2``: the next power of two of the true total length (prompt + output tokens), capped
  at ``max_model_len`` (at most 2x over-reservation);
- ``orca-oracle``: exactly the true total length.

The true total length is ``Sequence.max_num_tokens`` (prompt + max_tokens; exact when the request
sets ``ignore_eos``, as the benchmarks do). Here the run is a chunk of consecutive physical
blocks from a buddy allocator (``buddy_allocator``), so the block table is ``start, start + 1,
...`` and the model runs the same paged kernels as the paged engine: only the memory manager
differs. Reservations are in whole blocks of ``block_size`` tokens; the buddy allocator rounds a
reservation of ``n`` blocks up to a chunk of ``2**ceil(log2 n)`` blocks.

Admission is all-or-nothing: ``allocate_prefix`` reserves the whole run when the scheduler
admits the request, and a request never needs another block afterwards, so it is never
preempted for growth. No prefix caching, sharing or swapping.
"""

from __future__ import annotations

from pagedllm.core.block_allocator import NoFreeBlocksError
from pagedllm.core.buddy_allocator import BuddyAllocator, order_for
from pagedllm.core.kv_manager import (
    ContextLengthExceededError,
    cdiv,
    check_pool_fits,
    rollback_computed,
)
from pagedllm.core.kv_waste import KVWaste, contiguous_waste
from pagedllm.core.prefix_cache import PrefixCache
from pagedllm.sequence import Sequence

ORCA_POLICIES = ("orca-max", "orca-pow2", "orca-oracle")


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (n >= 1)."""
    return 1 << (n - 1).bit_length()


class ContiguousKVManager:
    """One contiguous reservation per sequence: an implementation of ``core.kv_manager.KVManager``.

    Block tables are ``start, start + 1, ...`` inside a buddy chunk, so the same paged kernels run
    on them. There is no prefix cache (``prefix_cache`` is None), no swap space
    (``num_swap_blocks`` is 0) and no sharing (``fork`` raises).

    Args:
        num_blocks: physical blocks in the pool.
        block_size: tokens per block.
        policy: "orca-max", "orca-pow2" or "orca-oracle" (see the module docstring).
        max_model_len: longest sequence in tokens (the ``orca-max`` reservation).

    Raises:
        ValueError: naming ``policy`` when unknown, or ``max_model_len`` when the ``orca-max``
            reservation is larger than the largest chunk the pool can give.
    """

    def __init__(self, num_blocks: int, block_size: int, policy: str, max_model_len: int) -> None:
        if policy not in ORCA_POLICIES:
            raise ValueError(f"policy must be one of {ORCA_POLICIES}, got {policy!r}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_swap_blocks = 0
        self.policy = policy
        self.max_model_len = max_model_len
        self.buddy = BuddyAllocator(num_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.swapped_tables: dict[int, list[int]] = {}  # always empty: no swapping
        self.prefix_cache: PrefixCache | None = None
        self._chunk_start: dict[int, int] = {}  # seq_id -> first block of its chunk
        self._chunk_blocks: dict[int, int] = {}  # seq_id -> blocks in its chunk
        self._covered: dict[int, int] = {}  # seq_id -> tokens its scheduled work covers
        if (
            policy == "orca-max"
            and (1 << order_for(cdiv(max_model_len, block_size))) > self.buddy.max_chunk_blocks
        ):
            raise ValueError(
                f"max_model_len: orca-max reserves {max_model_len} tokens "
                f"({cdiv(max_model_len, block_size)} blocks) per request, more than the largest "
                f"contiguous chunk of the pool ({self.buddy.max_chunk_blocks} blocks)"
            )

    # ---- reservation sizes -----------------------------------------------------------------
    def reservation_tokens(self, seq: Sequence) -> int:
        """KV slots (tokens) the policy reserves for ``seq``."""
        return self._reservation_for(seq.max_num_tokens)

    def _reservation_for(self, final_len: int | None) -> int:
        """Tokens reserved for a sequence whose final length is ``final_len`` (None: unknown,
        taken as ``max_model_len``)."""
        true_len = final_len or self.max_model_len
        if self.policy == "orca-max":
            return self.max_model_len
        if self.policy == "orca-pow2":
            return max(true_len, min(next_pow2(true_len), self.max_model_len))
        return true_len

    def reservation_blocks(self, seq: Sequence) -> int:
        """Blocks of the reservation (before the buddy allocator's power-of-two rounding)."""
        return cdiv(self.reservation_tokens(seq), self.block_size)

    def chunk_blocks_for(self, seq: Sequence) -> int:
        """Blocks of the buddy chunk that would hold ``seq``'s reservation."""
        return self._chunk_for(seq.max_num_tokens)

    def _chunk_for(self, final_len: int | None) -> int:
        return 1 << order_for(cdiv(self._reservation_for(final_len), self.block_size))

    def reserved_chunk_blocks(self, seq: Sequence) -> int:
        """Blocks of the chunk ``seq`` holds now (0 when it holds none)."""
        return self._chunk_blocks.get(seq.seq_id, 0)

    def fits_pool(self, seq: Sequence) -> bool:
        """Whether the empty pool could ever hold ``seq``'s reservation."""
        return self.chunk_blocks_for(seq) <= self.buddy.max_chunk_blocks

    # ---- queries (KVManager) ---------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks in no chunk."""
        return self.buddy.num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks inside allocated chunks (the buddy rounding included)."""
        return self.buddy.num_used

    def usage(self) -> float:
        """Fraction of the pool inside allocated chunks, 0..1."""
        return self.buddy.num_used / self.num_blocks

    def ref_counts(self) -> list[int]:
        """1 for a block inside an allocated chunk, 0 otherwise (index = block id)."""
        return self.buddy.ref_counts

    def swap_ref_counts(self) -> list[int] | None:
        """None: no swap space."""
        return None

    def check_request_fits(
        self, prompt_len: int, max_tokens: int, num_samples: int, use_beam_search: bool,
        samples_field: str = "n",
    ) -> None:
        """Refuse requests of several sequences, and requests whose reservation needs a chunk
        larger than the whole pool could give.

        Raises:
            ValueError: (message starting with ``samples_field``) for parallel sampling or beam
                search.
            ContextLengthExceededError: (param "max_tokens") naming the reservation and chunk.
        """
        if num_samples > 1 or use_beam_search:
            raise ValueError(
                f"{samples_field}: kv_manager={self.policy!r} reserves one contiguous run per "
                "request and cannot share it; parallel sampling and beam search need 'paged'"
            )
        final_len = prompt_len + max_tokens
        chunk = self._chunk_for(final_len)
        if chunk > self.buddy.max_chunk_blocks:
            raise ContextLengthExceededError(
                f"max_tokens: the {self.policy} reservation of "
                f"{self._reservation_for(final_len)} tokens needs a chunk of "
                f"{chunk} blocks, more than the pool's largest "
                f"({self.buddy.max_chunk_blocks} blocks of {self.block_size} tokens)",
                "max_tokens",
            )
        check_pool_fits(self.num_blocks, self.block_size, prompt_len, max_tokens, num_samples)

    def waste(self, holders: list[Sequence], waiting_head: Sequence | None) -> KVWaste:
        """The figure 2 breakdown (``core.kv_waste.contiguous_waste``)."""
        return contiguous_waste(self, holders, waiting_head)

    # ---- the scheduler's interface ---------------------------------------------------------
    def cached_prefix_blocks(self, seq: Sequence) -> list[int]:
        """[]: no prefix cache."""
        return []

    def group_shared_blocks(self, seqs: list[Sequence]) -> int:
        """0: nothing is shared."""
        return 0

    def can_share_prefix(self, lead: Sequence, num_blocks: int) -> bool:
        """False: nothing is shared."""
        return False

    def share_prefix(self, lead: Sequence, other: Sequence, num_blocks: int) -> int:
        """Never called (``group_shared_blocks`` is 0).

        Raises:
            ValueError: always.
        """
        raise ValueError("n: parallel sampling and beam search need kv_manager='paged'")

    def can_allocate(self, seqs: list[Sequence], watermark: bool = True) -> bool:
        """Whether every sequence's whole reservation fits in a free chunk now (no watermark:
        a reserved request never grows)."""
        if len(seqs) != 1:
            return False  # several sequences are refused by check_request_fits
        return self.buddy.can_allocate(self.reservation_blocks(seqs[0]))

    def first_chunk_room(self, seqs: list[Sequence]) -> int:
        """0: a reservation is whole (``can_allocate``); no window frees part of it."""
        return 0

    def allocate_prefix(self, seq: Sequence) -> int:
        """Admission: reserve the sequence's whole contiguous run; returns 0 (no cached tokens).

        Raises:
            NoFreeBlocksError: when no chunk fits (check ``can_allocate`` first).
        """
        n = self.reservation_blocks(seq)
        start, size = self.buddy.allocate(n)
        self._chunk_start[seq.seq_id] = start
        self._chunk_blocks[seq.seq_id] = size
        self._covered[seq.seq_id] = 0
        self.block_tables[seq.seq_id] = list(range(start, start + n))
        return 0

    def num_new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """0 while the work stays inside the reservation (always, for validated requests)."""
        table = self.block_tables.get(seq.seq_id, [])
        return max(0, cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(table))

    def num_blocks_needed(self, plan: list[tuple[Sequence, int]]) -> int:
        """``num_new_blocks_needed`` summed over ``plan`` (nothing is shared here)."""
        return sum(self.num_new_blocks_needed(s, n) for s, n in plan)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Mark ``num_new_tokens`` more slots of the reservation as written this step.

        Raises:
            NoFreeBlocksError: when the tokens would run past the reservation.
        """
        end = seq.num_computed_tokens + num_new_tokens
        if end > len(self.block_tables.get(seq.seq_id, [])) * self.block_size:
            raise NoFreeBlocksError(
                f"sequence {seq.seq_id}: {end} tokens exceed its reservation of "
                f"{self.reservation_tokens(seq)} tokens"
            )
        self._covered[seq.seq_id] = end
        return []

    def get_block_table(self, seq: Sequence) -> list[int]:
        """The blocks covering the tokens scheduled so far (the kernels read no further)."""
        table = self.block_tables.get(seq.seq_id, [])
        return table[: cdiv(self._covered.get(seq.seq_id, 0), self.block_size)]

    def rollback_slots(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Un-compute ``seq``'s last ``num_tokens`` tokens; the reservation stays whole, so no
        block is freed.

        Raises:
            ValueError: naming ``num_tokens`` when negative or more than the tokens computed.
        """
        rollback_computed(seq, num_tokens)
        self._covered[seq.seq_id] = seq.num_computed_tokens
        return []

    def mark_computed(self, seq: Sequence) -> None:
        """Nothing to do: no prefix cache."""

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Sharing is impossible here.

        Raises:
            ValueError: always (requests of several sequences are refused at admission).
        """
        raise ValueError("n: parallel sampling and beam search need kv_manager='paged'")

    def free(self, seq: Sequence) -> None:
        """Release the sequence's chunk (merging buddies)."""
        self.block_tables.pop(seq.seq_id, None)
        self._covered.pop(seq.seq_id, None)
        self._chunk_blocks.pop(seq.seq_id, None)
        start = self._chunk_start.pop(seq.seq_id, None)
        if start is not None:
            self.buddy.free(start)

    def reset_prefix_cache(self) -> int:
        """0: no prefix cache."""
        return 0

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        """False: no swap space (a preempted group is recomputed)."""
        return False

    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Never called (``can_swap_out`` is False).

        Raises:
            RuntimeError: always.
        """
        raise RuntimeError("the contiguous KV managers have no swap space")

    def can_swap_in(self, seqs: list[Sequence], reserve: bool = True) -> bool:
        """False: nothing is ever swapped out."""
        return False

    def swap_in(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Never called (nothing is swapped out).

        Raises:
            RuntimeError: always.
        """
        raise RuntimeError("the contiguous KV managers have no swap space")

    def check_invariants(self) -> None:
        """Assert the buddy chunks tile the pool and every table lies in its own chunk.

        Raises:
            AssertionError: describing the first violation.
        """
        self.buddy.check_invariants()
        chunks = self.buddy.allocated_chunks()
        assert len(chunks) == len(self._chunk_start), "chunks and reservations disagree"
        for sid, table in self.block_tables.items():
            start, size = self._chunk_start[sid], self._chunk_blocks[sid]
            assert chunks.get(start) == size, f"sequence {sid}: chunk at {start} not allocated"
            assert table == list(range(start, start + len(table))), (
                f"sequence {sid}: not contiguous"
            )
            assert len(table) <= size, f"sequence {sid}: table longer than its chunk"
