"""Where the KV memory goes: the paper's figure 2 breakdown, measured at one engine step.

Every number is in KV slots (one slot = the K and V of one token in one layer stack). The memory
counted ("accounted memory") is the KV memory allocated to requests plus free memory that is
stranded (see below); it splits into four disjoint parts:

- **token states**: slots holding the K/V of tokens already computed (a slot shared by several
  sequences counts once).
- **reserved**: slots allocated to a request that it *will* fill later: up to its final length
  (``Sequence.max_num_tokens`` = prompt + max_tokens, the true length under ``ignore_eos``).
  In the paged design only the unfilled part of a sequence's last block can be reserved.
- **internal fragmentation**: allocated slots the request will *never* fill: beyond its final
  length. Orca-Max: the reservation (``max_model_len``) minus the true length; Orca-Pow2: up to
  the next power of two; Orca-Oracle and paged: only the unfilled tail of the last block.
- **external fragmentation**: (a) the buddy allocator's rounding of a reservation of ``n`` blocks
  up to a chunk of ``2**ceil(log2 n)`` blocks (allocated to no request's table), and (b) stranded
  free memory: when the head-of-line waiting request's chunk does not fit in any free chunk
  although the free blocks add up to that chunk or more, *all* free slots count (FCFS admits
  nobody behind it, so none of them serve a request this step). Free memory that is simply not
  enough is not counted. The paged manager has none: any free block serves any request.

A sequence's final length may be unknown (None: its max_tokens is the model limit); then the
whole allocation is taken as reserved (no internal fragmentation is claimed).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.core.kv_manager import FREED_BLOCK

if TYPE_CHECKING:  # the managers import this module for their ``waste`` methods
    from pagedllm.core.block_manager import BlockManager
    from pagedllm.core.contiguous_kv_manager import ContiguousKVManager
    from pagedllm.sequence import Sequence


@dataclass
class KVWaste:
    """KV slots (tokens) by use at one step; see the module docstring for the definitions."""

    token_states: int = 0
    reserved: int = 0
    internal_fragmentation: int = 0
    external_fragmentation: int = 0

    @property
    def total(self) -> int:
        """All accounted slots (the four parts add up to it)."""
        return (
            self.token_states
            + self.reserved
            + self.internal_fragmentation
            + self.external_fragmentation
        )


def _final_len(seq: Sequence, capacity: int) -> int:
    return capacity if seq.max_num_tokens is None else seq.max_num_tokens


def paged_waste(bm: BlockManager, seqs: Iterable[Sequence]) -> KVWaste:
    """Breakdown for the paged block manager over the sequences holding blocks.

    Shared blocks count once in the allocated memory and in the token states; reserved slots
    are counted per sequence (its own last block), and internal fragmentation is the rest.
    """
    bs = bm.block_size
    ref_counts = bm.allocator.ref_counts
    filled: dict[int, int] = {}  # shared or partly freed tables' blocks: tokens held, at most
    held = 0
    future = 0
    for s in seqs:
        table = bm.block_tables.get(s.seq_id)
        if not table:
            continue
        n = s.num_computed_tokens
        capacity = len(table) * bs
        if FREED_BLOCK not in table and max(map(ref_counts.__getitem__, table)) == 1:
            # Every block is this sequence's alone (the common case; a C-speed check): its
            # tokens fill its table from the front.
            held += min(n, capacity)
        else:
            for i, b in enumerate(table):
                if b != FREED_BLOCK:  # freed behind the sliding window: holds nothing
                    filled[b] = max(filled.get(b, 0), min(bs, n - i * bs))
        future += max(0, min(capacity, _final_len(s, capacity)) - n)
    held += sum(v for v in filled.values() if v > 0)
    allocated = bm.num_used_blocks * bs
    future = min(future, allocated - held)
    return KVWaste(held, future, allocated - held - future, 0)


def contiguous_waste(
    mgr: ContiguousKVManager, seqs: Iterable[Sequence], waiting_head: Sequence | None
) -> KVWaste:
    """Breakdown for the contiguous (Orca) manager over the sequences holding reservations.

    Args:
        mgr: the manager.
        seqs: sequences holding a reservation.
        waiting_head: the first waiting sequence (for stranded free memory), or None.
    """
    bs = mgr.block_size
    w = KVWaste()
    for s in seqs:
        table = mgr.block_tables.get(s.seq_id)
        if not table:
            continue
        capacity = len(table) * bs
        final = min(capacity, _final_len(s, capacity))
        held = min(s.num_computed_tokens, final)
        w.token_states += held
        w.reserved += final - held
        w.internal_fragmentation += capacity - final
        w.external_fragmentation += (mgr.reserved_chunk_blocks(s) - len(table)) * bs
    if waiting_head is not None and mgr.fits_pool(waiting_head):
        need = mgr.chunk_blocks_for(waiting_head)
        if mgr.buddy.num_free >= need and mgr.buddy.largest_free_chunk() < need:
            w.external_fragmentation += mgr.buddy.num_free * bs
    return w
