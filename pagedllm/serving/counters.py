"""Summing the counters of several engines (the data-parallel front's ``counters``)."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from pagedllm.engine.kv_snapshot import EngineCounters

__all__ = ["sum_counters"]


def _sum_dataclass(items: Sequence[Any]) -> Any:
    """Field-wise sum of dataclass instances (numbers summed; other fields from the first)."""
    first = items[0]
    values: dict[str, Any] = {}
    for f in dataclasses.fields(first):
        vals = [getattr(x, f.name) for x in items]
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in vals):
            values[f.name] = sum(vals)
        elif all(v is None or isinstance(v, int | float) for v in vals):
            nums = [v for v in vals if v is not None]
            values[f.name] = sum(nums) if nums else None
        else:
            values[f.name] = vals[0]
    return dataclasses.replace(first, **values)


def sum_counters(counters: Sequence[EngineCounters]) -> EngineCounters:
    """The counters of several replicas as one engine's: pool sizes, queue lengths and cumulative
    counters summed; the prefix-cache hit rate recomputed from the summed hits and queries.

    Raises:
        ValueError: naming ``counters`` when it is empty.
    """
    if not counters:
        raise ValueError("counters must not be empty")
    total = _sum_dataclass(counters)
    by_mode: Counter[str] = Counter()
    for c in counters:
        by_mode.update(c.preemptions_by_mode)
    queries = total.prefix_cache_query_tokens
    rate = (
        None
        if queries is None
        else ((total.prefix_cache_hit_tokens or 0) / queries if queries else 0.0)
    )
    return dataclasses.replace(
        total,
        monotonic=time.monotonic(),
        block_size=counters[0].block_size,
        preemptions_by_mode=dict(by_mode),
        prefix_cache_hit_rate=rate,
        stats=_sum_dataclass([c.stats for c in counters]),
    )
