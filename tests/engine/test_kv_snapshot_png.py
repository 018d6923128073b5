"""The static block-map PNG tool draws a real snapshot (tiny model, parallel sampling)."""

from pagedllm.engine.kv_snapshot import kv_snapshot
from pagedllm.sampling_params import SamplingParams
from pagedllm.tools.kv_snapshot_png import draw_block_map


def test_block_map_png(tiny_llm_factory, tmp_path):
    llm = tiny_llm_factory(block_size=4, num_gpu_blocks_override=40)
    eng = llm.engine
    shared = "paged attention stores keys and values in blocks "
    eng.add_request(
        "a", shared + "hello", SamplingParams(n=4, seed=1, temperature=1.0, max_tokens=8)
    )
    eng.add_request(
        "b", shared + "world", SamplingParams(n=2, seed=2, temperature=1.0, max_tokens=8)
    )
    for _ in range(3):
        eng.step()
    snap = kv_snapshot(eng, max_cells=10**9)
    assert snap["counters"]["blocks_shared"] > 0
    out = tmp_path / "map.png"
    draw_block_map(snap, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    for rid in ("a", "b"):
        eng.abort_request(rid)
