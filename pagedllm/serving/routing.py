"""Which replica serves a request: the router's policies and its decision counters.

``cache_aware`` (default): the key is a hash of the request's first full KV blocks (``block_size``
tokens each, after tokenization and chat templating, up to ``prefix_blocks`` of them); the key is
placed on a consistent-hashing ring with bounded loads (``hash_ring``), so requests sharing a prefix
meet on the replica whose prefix cache holds it. A prompt shorter than one block has no reusable
block: it goes to the least loaded replica. ``round_robin`` and ``least_loaded`` ignore the prompt.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pagedllm.serving.hash_ring import BoundedLoadRing, stable_hash

__all__ = ["ROUTER_POLICIES", "ReplicaRouter", "prefix_key"]

#: The ``--router-policy`` choices.
ROUTER_POLICIES = ("cache_aware", "round_robin", "least_loaded")


def prefix_key(token_ids: Sequence[int], block_size: int, max_blocks: int) -> int | None:
    """The hash of the prompt's first full blocks (at most ``max_blocks``); None when the prompt
    is shorter than one block."""
    n_full = min(len(token_ids) // block_size, max_blocks)
    if n_full == 0:
        return None
    head = token_ids[: n_full * block_size]
    return stable_hash(b",".join(str(t).encode() for t in head))


class ReplicaRouter:
    """Picks a replica per request and counts its decisions.

    Args:
        num_replicas: replicas behind the router.
        policy: one of ``ROUTER_POLICIES``.
        block_size: tokens per KV block of the replicas' engines.
        prefix_blocks: most full blocks hashed into a request's key.
        epsilon: the bounded-load slack (``BoundedLoadRing``).

    ``decisions`` counts outcomes: ``prefix`` (the key's home replica), ``prefix_spill`` (the home
    was full or out of rotation: the next on the ring), ``short_prompt`` (under one block: least
    loaded), ``round_robin``, ``least_loaded``.

    Raises:
        ValueError: naming ``policy``, ``block_size`` or ``prefix_blocks`` when invalid.
    """

    def __init__(
        self,
        num_replicas: int,
        policy: str = "cache_aware",
        block_size: int = 16,
        prefix_blocks: int = 8,
        epsilon: float = 0.25,
    ) -> None:
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"policy must be one of {list(ROUTER_POLICIES)}, got {policy!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if prefix_blocks < 1:
            raise ValueError(f"prefix_blocks must be >= 1, got {prefix_blocks}")
        self.policy = policy
        self.block_size = block_size
        self.prefix_blocks = prefix_blocks
        self.ring = BoundedLoadRing(num_replicas, epsilon=epsilon)
        self.num_replicas = num_replicas
        self._next = 0
        self.decisions: Counter[str] = Counter()

    def choose(
        self, token_ids: Sequence[int], loads: Sequence[int], eligible: Sequence[bool]
    ) -> int | None:
        """The replica for a prompt, given each replica's in-flight requests and whether it is in
        rotation; None when none is."""
        live = [r for r in range(self.num_replicas) if eligible[r]]
        if not live:
            return None
        if self.policy == "round_robin":
            for step in range(self.num_replicas):
                r = (self._next + step) % self.num_replicas
                if eligible[r]:
                    self._next = r + 1
                    self.decisions["round_robin"] += 1
                    return r
        key = None
        if self.policy == "cache_aware":
            key = prefix_key(token_ids, self.block_size, self.prefix_blocks)
        if key is None:
            self.decisions["short_prompt" if self.policy == "cache_aware" else "least_loaded"] += 1
            return min(live, key=lambda r: (loads[r], r))
        chosen = self.ring.choose(key, loads, eligible)
        self.decisions["prefix" if chosen == self.ring.home(key) else "prefix_spill"] += 1
        return chosen
