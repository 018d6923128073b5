"""Metric arithmetic (TTFT / TPOT / normalized latency / percentiles), Poisson arrivals, and the
streaming client against a fake server."""

import asyncio
import json
import math

import httpx
import numpy as np
import pytest

from pagedllm.bench.datasets import BenchRequest
from pagedllm.bench.metrics import (
    RequestResult,
    distribution,
    normalized_latency,
    summarize,
    tpot,
)
from pagedllm.bench.serve import poisson_send_times, run_serve_bench


def test_tpot_excludes_the_first_token():
    assert tpot(e2e=10.0, ttft=1.0, output_tokens=10) == pytest.approx(1.0)
    assert tpot(e2e=3.0, ttft=3.0, output_tokens=1) is None
    with pytest.raises(ValueError, match="e2e"):
        tpot(e2e=1.0, ttft=2.0, output_tokens=5)


def test_normalized_latency():
    assert normalized_latency(6.0, 3) == 2.0
    with pytest.raises(ValueError, match="output_tokens"):
        normalized_latency(1.0, 0)


def test_distribution_percentiles():
    d = distribution([1.0, 2.0, 3.0, 4.0])
    assert d == pytest.approx({"mean": 2.5, "p50": 2.5, "p90": 3.7, "p99": 3.97})
    assert distribution([])["p99"] is None


def test_summarize_counts_failures_and_averages_per_request():
    results = [
        RequestResult(True, prompt_len=5, output_tokens=4, ttft=1.0, e2e=4.0),  # 1 s/token
        RequestResult(True, prompt_len=7, output_tokens=2, ttft=0.5, e2e=6.0),  # 3 s/token
        RequestResult(False, error="HTTP 500: boom", e2e=0.1),
    ]
    s = summarize(results, duration=10.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["errors"] == {"HTTP 500: boom": 1}
    assert s["request_throughput"] == pytest.approx(0.2)
    assert s["output_throughput"] == pytest.approx(0.6)
    # Mean of per-request ratios (2.0), not total latency / total tokens (10 / 6).
    assert s["normalized_latency_s_per_token"]["mean"] == pytest.approx(2.0)
    assert s["tpot_s"]["mean"] == pytest.approx((1.0 + 5.5) / 2)
    assert s["ttft_s"]["mean"] == pytest.approx(0.75)
    with pytest.raises(ValueError, match="duration"):
        summarize(results, 0.0)


def test_poisson_send_times():
    t = poisson_send_times(20001, 4.0, seed=0)
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
    assert np.mean(np.diff(t)) == pytest.approx(0.25, rel=0.03)
    assert t == poisson_send_times(20001, 4.0, seed=0)
    assert poisson_send_times(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="request_rate"):
        poisson_send_times(3, 0.0)


def fake_server(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/debug/engine_stats":
        return httpx.Response(404)
    if request.url.path == "/v1/models":
        return httpx.Response(200, json={"data": [{"id": "fake"}]})
    body = json.loads(request.content)
    assert body["ignore_eos"] is True and body["stream"] is True and body["model"] == "fake"
    if body["prompt"] == "fail":
        return httpx.Response(503, text="overloaded")
    n = body["max_tokens"]
    events = [{"choices": [{"index": 0, "text": f"t{i}"}]} for i in range(n)]
    events.append({"choices": [], "usage": {"completion_tokens": n}})
    sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})


def test_client_against_fake_server_counts_errors():
    reqs = [BenchRequest("hello", 1, 3), BenchRequest("fail", 1, 2), BenchRequest("x", 1, 5)]
    r = asyncio.run(
        run_serve_bench(
            "http://fake",
            reqs,
            request_rate=math.inf,
            max_concurrency=2,
            progress=False,
            transport=httpx.MockTransport(fake_server),
        )
    )
    assert (r["completed"], r["failed"]) == (2, 1)
    assert r["total_output_tokens"] == 8 and r["output_len_mismatch"] == 0
    assert list(r["errors"]) == ["HTTP 503: overloaded"]
    assert r["engine_stats"] is None  # not a pagedllm server
    assert r["ttft_s"]["mean"] is not None
