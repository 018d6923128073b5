"""The router's Prometheus metrics: its decisions by policy outcome and each replica's load."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["RouterCollector"]


class RouterCollector(Collector):
    """Reads a ``DataParallelEngine`` at scrape time.

    Metrics: ``pagedllm:router_decisions_total{policy,outcome}``, ``pagedllm:router_retries_total``,
    and per ``replica``: ``pagedllm:replica_in_rotation``, ``pagedllm:replica_in_flight``,
    ``pagedllm:replica_requests_running``, ``pagedllm:replica_requests_waiting``,
    ``pagedllm:replica_failures_total`` (times taken out of rotation),
    ``pagedllm:replica_failed_requests_total``, ``pagedllm:replica_prefix_cache_hit_rate``.
    """

    def __init__(self, dp_engine: Any) -> None:
        self.dp = dp_engine

    def collect(self) -> Iterator[Metric]:
        router = self.dp.router
        d = CounterMetricFamily(
            "pagedllm:router_decisions",
            "Routing decisions by policy and outcome (prefix, prefix_spill, short_prompt, "
            "round_robin, least_loaded).",
            labels=["policy", "outcome"],
        )
        for outcome, n in sorted(router.decisions.items()):
            d.add_metric([router.policy, outcome], n)
        yield d
        yield CounterMetricFamily(
            "pagedllm:router_retries",
            "Requests resubmitted to another replica after theirs failed before streaming.",
            value=self.dp.num_retries,
        )
        gauges = {
            "in_rotation": "1 while the replica takes requests, 0 while it is out (dead, restarting).",
            "in_flight": "Requests the router has in flight on the replica.",
            "running": "Requests in the replica's running batch.",
            "waiting": "Requests waiting in the replica's scheduler.",
            "prefix_cache_hit_rate": "The replica's prefix-cache block hit rate.",
        }
        counters = {
            "failures": "Times the replica was taken out of rotation.",
            "failed_requests": "Requests that failed because the replica died.",
        }
        loads = self.dp.replica_loads()
        for key, doc in gauges.items():
            name = f"pagedllm:replica_{'requests_' if key in ('running', 'waiting') else ''}{key}"
            g = GaugeMetricFamily(name, doc, labels=["replica"])
            for i, load in enumerate(loads):
                g.add_metric([str(i)], float(load[key] or 0.0))
            yield g
        for key, doc in counters.items():
            c = CounterMetricFamily(f"pagedllm:replica_{key}", doc, labels=["replica"])
            for i, load in enumerate(loads):
                c.add_metric([str(i)], load[key])
            yield c
