"""``bench serve`` against a real pagedllm server on the tiny model: a burst of concurrent
streaming clients completes with no error, the engine counters come back through
/debug/engine_stats, and every KV block is free afterwards; once per KV manager."""

import asyncio
import math

import pytest

from pagedllm.bench.datasets import BenchRequest
from pagedllm.bench.serve import run_serve_bench
from pagedllm.entrypoints.openai.api_server import build_app
from tests.entrypoints.server_utils import ServerThread, wait_idle


@pytest.mark.parametrize("kv_manager", ["paged", "orca-oracle"])
def test_burst_of_streaming_clients_leaves_the_pool_empty(tiny_loaded, kv_manager):
    app = build_app(
        {
            "max_model_len": 128,
            "block_size": 4,
            "num_gpu_blocks_override": 64,
            "check_invariants": True,
            "num_threads": 1,
            "kv_manager": kv_manager,
        },
        loaded=tiny_loaded,
        served_model_name="tiny",
        enable_dashboard=True,  # mounts /debug/engine_stats
    )
    srv = ServerThread(app).start()
    try:
        reqs = [BenchRequest([5 + i % 50] * (3 + i % 7), 3 + i % 7, 2 + i % 5) for i in range(40)]
        r = asyncio.run(
            run_serve_bench(
                srv.url, reqs, request_rate=math.inf, max_concurrency=30, progress=False
            )
        )
        assert (r["completed"], r["failed"], r["output_len_mismatch"]) == (40, 0, 0)
        assert r["total_output_tokens"] == sum(q.output_len for q in reqs)
        st = r["engine_stats"]
        assert st["kv_manager"] == kv_manager
        assert st["generation_tokens"] == r["total_output_tokens"]
        assert st["mean_batched_requests"] > 1
        assert sum(st["memory_waste"].values()) == pytest.approx(1.0)
        wait_idle(srv.engine)
    finally:
        srv.stop()


def test_discover_model_says_why_it_found_none():
    import httpx

    from pagedllm.bench.serve import discover_model

    def refused(request):
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    def answer(status, body):
        return lambda request: httpx.Response(status, json=body)

    def find(handler):
        return asyncio.run(discover_model("http://h:1", transport=httpx.MockTransport(handler)))

    assert find(answer(200, {"data": [{"id": "m"}]})) == "m"
    with pytest.raises(ValueError, match=r"^base_url: cannot reach http://h:1/v1/models: "
                                         r"ConnectError: \[Errno 111\] Connection refused$"):
        find(refused)
    with pytest.raises(ValueError, match=r"^base_url: no model listed at .*\(HTTP 200\)$"):
        find(answer(200, {"data": []}))
    with pytest.raises(ValueError, match=r"\(HTTP 401\)$"):
        find(answer(401, {"error": {}}))
