"""Automatic prefix caching: full KV blocks found again by a hash of everything before them.

A full block's key is SHA-256 over its parent block's key, its token ids and any extra key that
changes the K/V (a cache salt). Chaining makes a key identify the whole prefix up to and
including the block, so equal keys mean equal K/V (section 4.4 of the paper shares prefixes
explicitly; automatic caching finds them by content, as later vLLM versions do).

Cached blocks stay in the map while they are free (reference count 0) and sit in the allocator's
free list; they are evicted, in LRU order, only when the allocator hands them out again.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra: bytes | None = None) -> bytes:
    """SHA-256 key of one full block.

    Args:
        parent: key of the previous block of the sequence, None for the first block.
        token_ids: the block's ``block_size`` token ids.
        extra: bytes that change the K/V for the same tokens (e.g. a cache salt), or None.

    Returns:
        32 bytes.
    """
    h = hashlib.sha256()
    h.update(parent or b"\x00" * 32)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra:
        h.update(b"\x01")
        h.update(extra)
    return h.digest()


class PrefixCache:
    """Two-way map between block keys and physical block ids, plus hit statistics.

    Attributes:
        queries / hits: blocks looked up at admission and blocks found (for the hit rate).
    """

    def __init__(self) -> None:
        self.block_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.queries = 0
        self.hits = 0
        self.evictions = 0

    def lookup(self, key: bytes) -> int | None:
        """The block holding the prefix ``key``, or None."""
        return self.block_of.get(key)

    def register(self, block_id: int, key: bytes) -> None:
        """Remember that ``block_id`` holds the prefix ``key``. If another block already holds
        it, the first one stays the cached copy (both hold the same K/V)."""
        if key in self.block_of or block_id in self.key_of:
            return
        self.block_of[key] = block_id
        self.key_of[block_id] = key

    def evict(self, block_id: int) -> bool:
        """Forget ``block_id``'s key (it is being reused for other tokens)."""
        key = self.key_of.pop(block_id, None)
        if key is None:
            return False
        del self.block_of[key]
        self.evictions += 1
        return True

    def is_cached(self, block_id: int) -> bool:
        """Whether ``block_id`` holds a registered prefix."""
        return block_id in self.key_of

    @property
    def hit_rate(self) -> float:
        """Blocks found / blocks looked up at admission, 0..1 (0 before any lookup)."""
        return self.hits / self.queries if self.queries else 0.0
