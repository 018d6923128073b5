"""KV snapshots (``pagedllm.engine.kv_snapshot``) on the tiny model: invariants at every step of
runs with parallel sampling, a shared prefix, swapping and recompute, and no prompt text."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from pagedllm.engine.kv_snapshot import STATE_NAMES, build_snapshot, capture, kv_snapshot
from pagedllm.sampling_params import SamplingParams

# Words that cannot appear in a snapshot's keys, so finding one means text leaked.
PREFIX = "zanzibar quokka xylophone marmalade; "
PROMPTS = [
    PREFIX + "the quick brown fox jumps over the lazy dog",
    PREFIX + "hello world, hello engine; 123 456 789!",
    "wombat kumquat continuous batching",
]
SECRET_WORDS = ["zanzibar", "quokka", "xylophone", "marmalade", "wombat", "kumquat"]


def check_snapshot(snap: dict, engine) -> None:
    """The invariants every snapshot must satisfy (and agree with the engine)."""
    c = snap["counters"]
    b = snap["blocks"]
    bs = snap["config"]["block_size"]
    assert c["blocks_used"] + c["blocks_free"] == c["blocks_total"] == b["num_blocks"]
    assert c["blocks_used"] == engine.block_manager.num_used_blocks
    assert c["blocks_evictable"] == engine.block_manager.num_cached_free_blocks
    entries = [
        blk
        for r in snap["requests"]
        for s in r["seqs"]
        if s["pool"] == "device"
        for blk in s["block_table"]
        if blk != -1  # FREED_BLOCK: freed behind a sliding window
    ]
    assert c["block_table_entries"] == len(entries)
    if b["mode"] == "blocks":
        rc = b["ref_count"]
        assert sum(rc) == len(entries), "sum of reference counts != device block-table entries"
        assert Counter(entries) == Counter({i: n for i, n in enumerate(rc) if n})
        assert sum(1 for n in rc if n) == c["blocks_used"]
        for i, n in enumerate(rc):
            state = STATE_NAMES[b["state"][i]]
            assert (n > 0) == state.startswith("used")
            if "owners" in b:
                assert len(b["owners"][i]) == n
            assert 0 <= b["filled"][i] <= bs
            assert (b["owner_request"][i] >= 0) == (n > 0)
        held = sum(f for f, n in zip(b["filled"], rc) if n)
        assert held == c["tokens_held"]
        if c["blocks_used"]:
            assert c["useful_token_fraction"] == pytest.approx(held / (c["blocks_used"] * bs))
    else:
        cells = b["cells"]
        assert sum(cells["used"]) == c["blocks_used"]
        assert sum(cells["size"]) == b["num_blocks"]
        assert len(cells["used"]) <= snap.get("_max_cells", 10**9)
    if snap["swap_blocks"] is not None and snap["swap_blocks"]["mode"] == "blocks":
        swap_entries = [
            blk
            for r in snap["requests"]
            for s in r["seqs"]
            if s["pool"] == "swap"
            for blk in s["block_table"]
            if blk != -1
        ]
        assert sum(snap["swap_blocks"]["ref_count"]) == len(swap_entries)
    for r in snap["requests"]:
        assert r["state"] in ("running", "waiting", "swapped")
        for s in r["seqs"]:
            filled_need = -(-s["num_computed_tokens"] // bs)
            if s["pool"] != "none":
                assert len(s["block_table"]) >= filled_need
    json.dumps(snap)  # JSON-able


def assert_no_text(snap: dict, engine, prompts: list[str]) -> None:
    payload = json.dumps(snap)
    for p in prompts:
        assert p not in payload
    for word in SECRET_WORDS:
        assert word not in payload, f"prompt text {word!r} leaked into a snapshot"
    for g in engine.requests.values():
        for s in g.seqs:
            if s.output_text.strip() and len(s.output_text.strip()) >= 6:
                assert s.output_text.strip() not in payload


def run_checked(engine, prompts, max_steps=400):
    snaps = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        snap = kv_snapshot(engine)
        check_snapshot(snap, engine)
        assert_no_text(snap, engine, prompts)
        snaps.append(snap)
    assert not engine.has_unfinished_requests()
    return snaps


def test_parallel_sampling_and_shared_prefix(tiny_llm_factory):
    llm = tiny_llm_factory(block_size=4, num_gpu_blocks_override=256, swap_space=0)
    eng = llm.engine
    sp = SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=20, ignore_eos=True)
    eng.add_request("first", PROMPTS[0], sp)
    for _ in range(3):
        eng.step()
    eng.add_request("second", PROMPTS[1], sp)
    eng.add_request("third", PROMPTS[2], SamplingParams(max_tokens=10, ignore_eos=True))
    snap0 = kv_snapshot(eng)
    check_snapshot(snap0, eng)
    assert [r["state"] for r in snap0["requests"]] == ["running", "waiting", "waiting"]
    assert snap0["requests"][0]["n"] == 3
    snaps = run_checked(eng, PROMPTS)
    # Parallel samples shared blocks; the shared prefix was a prefix-cache hit.
    assert max(s["counters"]["blocks_shared"] for s in snaps) > 0
    assert snaps[-1]["counters"]["prefix_cache_hits"] > 0
    assert 0 < snaps[-1]["counters"]["prefix_cache_hit_rate"] <= 1
    assert any(STATE_NAMES[x] == "used_cached" for s in snaps for x in s["blocks"]["state"]), (
        "no cached block was ever owned"
    )
    final = snaps[-1]
    assert final["counters"]["blocks_used"] == 0
    assert final["counters"]["blocks_evictable"] > 0
    assert final["requests"] == []
    # Aggregated mode keeps the totals.
    agg = build_snapshot(capture(eng), max_cells=7)
    assert agg["blocks"]["mode"] == "cells"
    assert len(agg["blocks"]["cells"]["used"]) <= 7
    assert sum(agg["blocks"]["cells"]["evictable"]) == final["counters"]["blocks_evictable"]


def test_preemption_by_swap_and_recompute(tiny_llm_factory):
    for mode in ("swap", "recompute"):
        llm = tiny_llm_factory(
            block_size=4,
            num_gpu_blocks_override=48,
            swap_space=1 << 16,
            preemption_mode=mode,
        )
        eng = llm.engine
        sp = SamplingParams(n=2, seed=3, temperature=1.0, max_tokens=30, ignore_eos=True)
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"r{i}", p, sp)
        snaps = run_checked(eng, PROMPTS)
        assert snaps[-1]["counters"]["preemptions"] > 0, mode
        key = f"preemptions_{mode}"
        assert snaps[-1]["counters"][key] > 0
        if mode == "swap":
            assert any(s["counters"]["num_swapped"] for s in snaps)
            assert any(s["counters"]["swap_blocks_used"] for s in snaps)


def test_aggregate_majority_owner_and_large_pool(tiny_llm_factory):
    llm = tiny_llm_factory(block_size=4, num_gpu_blocks_override=100_000, swap_space=0)
    eng = llm.engine
    eng.add_request("a", PROMPTS[0], SamplingParams(n=2, seed=1, max_tokens=8, ignore_eos=True))
    eng.step()
    eng.step()
    snap = build_snapshot(capture(eng), max_cells=4096)
    snap["_max_cells"] = 4096
    check_snapshot(snap, eng)
    cells = snap["blocks"]["cells"]
    assert cells["group"] == 25 and cells["num_cells"] == 4000
    assert cells["owner_request"][0] == 0
    assert all(o == -1 for o in cells["owner_request"][1:])
    full = kv_snapshot(eng)
    check_snapshot(full, eng)
    while eng.has_unfinished_requests():
        eng.step()
