"""Consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing
with Bounded Loads", SODA 2018).

Every replica owns ``virtual_nodes`` points on a 64-bit ring. A key goes to the first point
clockwise from its own hash whose replica is below the load cap
``ceil((1 + epsilon) * (total_load + 1) / num_replicas)`` (the +1 counts the request being placed;
section 2 of the paper). Keys keep their replica while it has room, so requests that share a prompt
prefix meet the KV blocks that prefix left in that replica's prefix cache; no replica takes more than
the cap, so a hot prefix spills to the next replica on the ring instead of overloading one.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence

__all__ = ["BoundedLoadRing", "stable_hash"]


def stable_hash(data: bytes) -> int:
    """A 64-bit hash that is the same in every process (Python's ``hash`` is salted)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class BoundedLoadRing:
    """The ring of ``num_replicas`` replicas (ids ``0..num_replicas-1``).

    Args:
        num_replicas: replicas on the ring (>= 1).
        virtual_nodes: points per replica; more points even out the share of keys each gets.
        epsilon: the load slack of the paper (> 0): a replica takes at most
            ``ceil((1 + epsilon) * average load)`` requests.

    Raises:
        ValueError: naming ``num_replicas``, ``virtual_nodes`` or ``epsilon`` when out of range.
    """

    def __init__(self, num_replicas: int, virtual_nodes: int = 64, epsilon: float = 0.25) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be >= 1, got {virtual_nodes}")
        if not epsilon > 0:
            raise ValueError(f"epsilon must be > 0, got {epsilon}")
        self.num_replicas = num_replicas
        self.epsilon = epsilon
        points = sorted(
            (stable_hash(f"replica-{r}-vnode-{v}".encode()), r)
            for r in range(num_replicas)
            for v in range(virtual_nodes)
        )
        self._hashes = [h for h, _ in points]
        self._owners = [r for _, r in points]

    def capacity(self, total_load: int, num_eligible: int) -> int:
        """The load cap for the next request: ``ceil((1 + eps) * (total_load + 1) / n)``."""
        return max(1, math.ceil((1 + self.epsilon) * (total_load + 1) / max(1, num_eligible)))

    def home(self, key: int) -> int:
        """The replica owning ``key`` when loads are ignored (the first point clockwise)."""
        i = bisect.bisect_left(self._hashes, key % (1 << 64))
        return self._owners[i % len(self._owners)]

    def choose(self, key: int, loads: Sequence[int], eligible: Sequence[bool]) -> int | None:
        """The replica for ``key``: the first eligible one clockwise below the cap.

        Args:
            key: the request's 64-bit key (``stable_hash`` of its prefix).
            loads: requests in flight per replica (length ``num_replicas``).
            eligible: whether each replica may take requests (healthy, in rotation).

        Returns:
            a replica id, or None when no replica is eligible.
        """
        live = [r for r in range(self.num_replicas) if eligible[r]]
        if not live:
            return None
        cap = self.capacity(sum(loads[r] for r in live), len(live))
        start = bisect.bisect_left(self._hashes, key % (1 << 64))
        n = len(self._owners)
        for step in range(n):
            r = self._owners[(start + step) % n]
            if eligible[r] and loads[r] < cap:
                return r
        return min(live, key=lambda r: loads[r])  # unreachable with a cap above the mean
