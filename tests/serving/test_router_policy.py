"""The router's policies: consistent hashing with bounded loads, prefix keys, round robin."""

from __future__ import annotations

import math

import pytest

from pagedllm.serving.hash_ring import BoundedLoadRing, stable_hash
from pagedllm.serving.routing import ReplicaRouter, prefix_key


def test_prefix_key_uses_only_full_blocks():
    assert prefix_key([1, 2, 3], block_size=4, max_blocks=2) is None
    a = prefix_key([1, 2, 3, 4, 9], 4, 2)
    assert a == prefix_key([1, 2, 3, 4, 7, 7], 4, 2)  # same first full block
    assert a != prefix_key([1, 2, 3, 5, 9], 4, 2)
    # beyond max_blocks the tail does not matter
    assert prefix_key(list(range(12)) + [1], 4, 2) == prefix_key(list(range(8)) + [5] * 9, 4, 2)


def test_ring_sticks_to_home_until_cap_then_spills():
    ring = BoundedLoadRing(3, epsilon=0.5)
    key = 12345
    home = ring.home(key)
    eligible = [True] * 3
    assert ring.choose(key, [0, 0, 0], eligible) == home
    # cap = ceil(1.5 * (3 + 1) / 3) = 2: home at 2 is full
    loads = [0, 0, 0]
    loads[home] = 2
    loads[(home + 1) % 3] = 1
    assert ring.capacity(3, 3) == 2
    spilled = ring.choose(key, loads, eligible)
    assert spilled != home and loads[spilled] < 2
    # out of rotation: never chosen
    eligible[home] = False
    assert ring.choose(key, [0, 0, 0], eligible) != home
    assert ring.choose(key, [0, 0, 0], [False] * 3) is None


def test_ring_bounded_load_invariant():
    """Placing 300 keys one after another never puts a replica above the paper's cap."""
    ring = BoundedLoadRing(4, epsilon=0.25)
    loads = [0] * 4
    for k in range(300):
        cap = math.ceil(1.25 * (sum(loads) + 1) / 4)
        r = ring.choose(k * 7919 + 17, loads, [True] * 4)
        assert loads[r] < cap
        loads[r] += 1
    assert max(loads) <= math.ceil(1.25 * 300 / 4)


def test_ring_spreads_keys():
    ring = BoundedLoadRing(2)
    homes = [ring.home(stable_hash(str(k).encode())) for k in range(1000)]
    assert 300 < homes.count(0) < 700


def test_router_policies_and_decision_counts():
    prompt = list(range(40))
    r = ReplicaRouter(2, "cache_aware", block_size=16)
    first = r.choose(prompt, [0, 0], [True, True])
    assert r.choose(prompt[:32] + [99] * 5, [0, 0], [True, True]) == first
    assert r.choose([1, 2, 3], [3, 1], [True, True]) == 1  # short: least loaded
    assert r.decisions == {"prefix": 2, "short_prompt": 1}
    rr = ReplicaRouter(3, "round_robin")
    assert [rr.choose(prompt, [0] * 3, [True, False, True]) for _ in range(4)] == [0, 2, 0, 2]
    ll = ReplicaRouter(3, "least_loaded")
    assert ll.choose(prompt, [2, 1, 1], [True] * 3) == 1
    with pytest.raises(ValueError, match="policy"):
        ReplicaRouter(2, "random")
