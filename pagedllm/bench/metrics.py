"""Serving metrics of one benchmark run (paper section 6.2, figure 12).

Definitions (every time in seconds, measured by the client):

- **TTFT** (time to first token): from sending the request to receiving the first output text.
- **end-to-end latency**: from sending the request to receiving its last event.
- **TPOT** (time per output token): ``(e2e - TTFT) / (output_tokens - 1)``, the mean gap between
  output tokens after the first; undefined (left out) for requests with one output token.
- **normalized latency**: ``e2e / output_tokens`` per request (seconds per token), and its mean
  over requests: the paper's y-axis.
- **throughput**: completed requests per second and output tokens per second over the run's
  duration (first request sent to last response received).

Failed requests are counted and left out of every latency figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """What the client saw of one request.

    Attributes:
        success: the stream ended normally.
        prompt_len: prompt tokens.
        output_tokens: output tokens received (the server's usage count when it sends one).
        ttft: seconds to the first output text (None when none came).
        e2e: seconds to the end of the response.
        error: what went wrong, when not ``success``.
    """

    success: bool
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    error: str = ""


def tpot(e2e: float, ttft: float, output_tokens: int) -> float | None:
    """Time per output token after the first, seconds: ``(e2e - TTFT) / (output_tokens - 1)``;
    None when ``output_tokens`` < 2.

    Raises:
        ValueError: naming ``e2e`` when it is shorter than ``ttft``.
    """
    if e2e < ttft:
        raise ValueError(f"e2e ({e2e} s) must be >= ttft ({ttft} s)")
    if output_tokens < 2:
        return None
    return (e2e - ttft) / (output_tokens - 1)


def normalized_latency(e2e: float, output_tokens: int) -> float:
    """End-to-end latency per output token, seconds/token.

    Raises:
        ValueError: naming ``output_tokens`` when it is < 1.
    """
    if output_tokens < 1:
        raise ValueError(f"output_tokens must be >= 1, got {output_tokens}")
    return e2e / output_tokens


def distribution(values: list[float]) -> dict[str, float | None]:
    """Mean and the p50 / p90 / p99 percentiles (numpy's linear interpolation); None if empty."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values, dtype=float)
    out: dict[str, float | None] = {"mean": float(arr.mean())}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(arr, p))
    return out


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """Aggregate a run: counts, throughput, TTFT / TPOT / e2e / normalized latency distributions.

    Args:
        results: one per request sent.
        duration: seconds from the first request sent to the last response received.

    Raises:
        ValueError: naming ``duration`` when it is not positive.
    """
    if duration <= 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration}")
    ok = [r for r in results if r.success and r.output_tokens > 0]
    errors: dict[str, int] = {}
    for r in results:
        if not (r.success and r.output_tokens > 0):
            key = (r.error or "no output tokens")[:120]
            errors[key] = errors.get(key, 0) + 1
    out_tokens = sum(r.output_tokens for r in ok)
    tpots = [t for r in ok if r.ttft is not None for t in [tpot(r.e2e, r.ttft, r.output_tokens)]]
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_prompt_tokens": sum(r.prompt_len for r in ok),
        "total_output_tokens": out_tokens,
        "ttft_s": distribution([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": distribution([t for t in tpots if t is not None]),
        "e2e_latency_s": distribution([r.e2e for r in ok]),
        "normalized_latency_s_per_token": distribution(
            [normalized_latency(r.e2e, r.output_tokens) for r in ok]
        ),
    }
