"""``pagedllm bench serve``: an online client against any OpenAI-compatible server (paper
section 6.2, figure 12).

Requests arrive as a Poisson process at ``request_rate`` requests/s (exponential gaps from a
seeded generator; ``inf`` sends them all at once, a burst). Each request streams from
``/v1/completions`` with ``max_tokens`` = its reference output length, ``ignore_eos`` (an
extension field vLLM and pagedllm accept), greedy, and ``stream_options.include_usage`` so the
server's own token count is used. ``max_concurrency`` caps the requests in flight (the rest wait
in the client, and their latency starts when they are sent). Every failure (HTTP status, error
event, broken stream, timeout) is counted in the report, never raised.

Against a pagedllm server the client also reads ``/debug/engine_stats`` before and after the run
and reports the difference (batched requests per step, memory waste, preemptions); that route is
one of the dashboard's (on by default on 127.0.0.1, else ``--enable-dashboard``). Elsewhere
``engine_stats`` is None.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any

import httpx
import numpy as np
from tqdm.auto import tqdm

from pagedllm.bench.datasets import BenchRequest
from pagedllm.bench.metrics import RequestResult, summarize


def poisson_send_times(n: int, request_rate: float, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of ``n`` requests: cumulative exponential gaps of mean
    ``1 / request_rate``, the first at 0; all 0 for ``inf``.

    Raises:
        ValueError: naming ``request_rate`` when it is not > 0.
    """
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 requests/s (or inf), got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=n)
    gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]


async def _one(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    prompt_len: int,
) -> RequestResult:
    res = RequestResult(success=False, prompt_len=prompt_len)
    t0 = time.perf_counter()
    chunks = 0
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {body[:200]}"
                res.e2e = time.perf_counter() - t0
                return res
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if event.get("error"):
                    err = event["error"]
                    res.error = str(err.get("message", err) if isinstance(err, dict) else err)
                    break
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        chunks += 1
                        if res.ttft is None:
                            res.ttft = time.perf_counter() - t0
                usage = event.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
            res.e2e = time.perf_counter() - t0
            if done and not res.error:
                res.success = True
            elif not res.error:
                res.error = "stream ended without [DONE]"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
        res.e2e = time.perf_counter() - t0
    res.output_tokens = usage_tokens if usage_tokens is not None else chunks
    if res.success and res.ttft is None:
        res.success, res.error = False, "no output text"
    return res


async def _get_json(client: httpx.AsyncClient, url: str) -> dict[str, Any] | None:
    try:
        r = await client.get(url, timeout=10.0)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def discover_model(
    base_url: str, api_key: str | None = None, transport: httpx.AsyncBaseTransport | None = None
) -> str:
    """The first model id of ``GET /v1/models``.

    Raises:
        ValueError: naming ``base_url`` when the server cannot be reached (with the reason) or
            answers no model.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/models"
    async with httpx.AsyncClient(headers=headers, transport=transport) as client:
        try:
            r = await client.get(url, timeout=10.0)
        except httpx.HTTPError as e:
            raise ValueError(
                f"base_url: cannot reach {url}: {type(e).__name__}: {e}".rstrip(": ")
            ) from None
    try:
        data = r.json() if r.status_code == 200 else None
    except ValueError:
        data = None
    if not isinstance(data, dict) or not data.get("data"):
        raise ValueError(f"base_url: no model listed at {url} (HTTP {r.status_code})")
    return str(data["data"][0]["id"])


def engine_stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The pagedllm engine counters of the run: ``after - before`` of two /debug/engine_stats."""
    from pagedllm.engine.llm_engine import EngineStats

    delta = EngineStats.delta(before["stats"], after["stats"]).summary()
    return {
        "kv_manager": after.get("kv_manager"),
        "num_blocks": after.get("num_blocks"),
        "block_size": after.get("block_size"),
        "num_free_blocks_after": after.get("num_free_blocks"),
        **delta,
    }


async def run_serve_bench(
    base_url: str,
    requests: list[BenchRequest],
    *,
    model: str | None = None,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    api_key: str | None = None,
    timeout: float = 3600.0,
    progress: bool = True,
    transport: httpx.AsyncBaseTransport | None = None,
) -> dict[str, Any]:
    """Send ``requests`` to the server at ``base_url`` and summarize (see ``metrics``).

    Args:
        base_url: e.g. ``http://127.0.0.1:8000`` (no ``/v1``).
        requests: the workload, sent in order.
        model: the ``model`` field (default: the first of ``/v1/models``).
        request_rate: requests/s of the Poisson process; ``math.inf`` = all at once.
        max_concurrency: most requests in flight (None = no limit).
        seed: seeds the arrival times.
        api_key: sent as ``Authorization: Bearer``.
        timeout: seconds a single request may take.
        progress: show a tqdm bar.
        transport: an httpx transport to use instead of the network (tests).

    Raises:
        ValueError: naming ``request_rate`` / ``max_concurrency`` / ``requests`` when invalid,
            ``base_url`` when no model is listed.
    """
    if not requests:
        raise ValueError("requests must not be empty")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    send_at = poisson_send_times(len(requests), request_rate, seed)
    base = base_url.rstrip("/")
    if model is None:
        model = await discover_model(base, api_key, transport)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), disable=not progress, desc=f"rate {request_rate}")
    async with httpx.AsyncClient(
        headers=headers,
        limits=limits,
        timeout=httpx.Timeout(timeout, connect=60.0),
        transport=transport,
    ) as client:
        before = await _get_json(client, base + "/debug/engine_stats")
        start = time.perf_counter()

        async def task(i: int, req: BenchRequest) -> RequestResult:
            delay = start + send_at[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            payload = {
                "model": model,
                "prompt": req.prompt,
                "max_tokens": req.output_len,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if sem is None:
                r = await _one(client, base + "/v1/completions", payload, req.prompt_len)
            else:
                async with sem:
                    r = await _one(client, base + "/v1/completions", payload, req.prompt_len)
            bar.update(1)
            return r

        results = await asyncio.gather(*(task(i, r) for i, r in enumerate(requests)))
        duration = time.perf_counter() - start
        after = await _get_json(client, base + "/debug/engine_stats")
    bar.close()
    summary = summarize(list(results), duration)
    summary["output_len_mismatch"] = sum(
        1
        for r, q in zip(results, requests, strict=True)
        if r.success and r.output_tokens != q.output_len
    )
    summary["request_rate"] = "inf" if math.isinf(request_rate) else request_rate
    summary["max_concurrency"] = max_concurrency
    summary["model"] = model
    summary["base_url"] = base
    summary["engine_stats"] = (
        engine_stats_delta(before, after) if before is not None and after is not None else None
    )
    return summary
