"""Prometheus metrics of the server, named as vLLM names them (``vllm:...``).

Gauges and token counters are read at scrape time (a custom collector) from the counters the engine
thread publishes after every step (``AsyncLLMEngine.counters``): a scrape never touches the live
engine. The prompt-token counters are the server's own, counted when a request's first output
comes (its prompt then done): ``vllm:prompt_tokens_total`` counts every prompt token, prefix-cache
hits included (as vLLM counts them), ``vllm:prompt_tokens_cached_total`` the hits among them;
``vllm:prompt_tokens_computed_total`` (the engine's) the prompt tokens it ran through the model
(recomputation after preemption included). The latency histograms are observed when a request
finishes. Every app gets
its own ``CollectorRegistry`` so several servers can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedllm.outputs import RequestOutput

_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0,
)  # fmt: skip
_TPOT_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
)  # fmt: skip


class _EngineCollector(Collector):
    """Reads the engine's published counters at scrape time."""

    def __init__(self, async_engine: Any, model_name: str) -> None:
        self.async_engine = async_engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        c = self.async_engine.counters
        st = c.stats
        labels = ["model_name"]
        values = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in the running batch.",
            c.num_running,
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be scheduled.",
            c.num_waiting,
        )
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of KV-cache blocks in use (1 = full).",
            c.kv_usage,
        )
        yield gauge("vllm:num_kv_blocks", "KV-cache blocks in the pool.", c.num_blocks)
        yield counter(
            "vllm:prompt_tokens_computed",
            "Prompt tokens run through the model (not prefix-cache hits; again after a "
            "recompute preemption).",
            st.prompt_tokens,
        )
        yield counter("vllm:generation_tokens", "Tokens generated.", st.generation_tokens)
        yield from self._spec_decode_metrics(st, counter)
        yield counter(
            "vllm:num_preemptions", "Preemptions of running requests.", st.num_preemptions
        )
        yield counter(
            "pagedllm:interrupted_steps",
            "Decode steps stopped between layers to take a new request in "
            "(--interrupt-decode-for-prefill).",
            st.num_interrupted_steps,
        )
        by_mode = CounterMetricFamily(
            "vllm:num_preemptions_by_mode",
            "Preemptions by mode (swap or recompute).",
            labels=["model_name", "mode"],
        )
        for mode, n in c.preemptions_by_mode.items():
            by_mode.add_metric([self.model_name, mode], n)
        yield by_mode
        yield gauge(
            "vllm:num_requests_swapped", "Requests swapped out to host memory.", c.num_swapped
        )
        yield counter("vllm:swap_out_bytes", "Bytes of KV cache swapped out.", c.swap_out_bytes)
        yield counter("vllm:swap_in_bytes", "Bytes of KV cache swapped in.", c.swap_in_bytes)
        if c.prefix_cache_query_tokens is not None:
            yield counter(
                "vllm:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                c.prefix_cache_query_tokens,
            )
            yield counter(
                "vllm:prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                c.prefix_cache_hit_tokens or 0,
            )
            yield gauge(
                "vllm:prefix_cache_hit_rate",
                "Prefix-cache block hit rate.",
                c.prefix_cache_hit_rate or 0.0,
            )
        yield gauge(
            "vllm:kv_sharing_saving_perc",
            "Share of KV blocks saved by sharing (fork, copy-on-write, prefix caching), mean over steps.",
            st.sharing_saving,
        )

    def _spec_decode_metrics(self, st: Any, counter: Any) -> Iterator[Metric]:
        """Speculative decoding counters (vLLM's names): drafts, draft and accepted tokens, and
        accepted tokens per draft position (label ``position``)."""
        yield counter(
            "vllm:spec_decode_num_drafts", "Verifications of speculative proposals.",
            st.spec_num_drafts,
        )
        yield counter(
            "vllm:spec_decode_num_draft_tokens", "Speculative tokens proposed.",
            st.spec_draft_tokens,
        )
        yield counter(
            "vllm:spec_decode_num_accepted_tokens", "Speculative tokens accepted.",
            st.spec_accepted_tokens,
        )
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Speculative tokens accepted, by draft position (0-based).",
            labels=["model_name", "position"],
        )
        for pos, n in enumerate(st.spec_accepted_per_pos):
            per_pos.add_metric([self.model_name, str(pos)], n)
        yield per_pos


class ServerMetrics:
    """The metrics of one app.

    Args:
        async_engine: the ``AsyncLLMEngine`` (its ``counters`` are read at scrape time).
        model_name: value of the ``model_name`` label.
        registry: where to register (default: a fresh ``CollectorRegistry``).
    """

    def __init__(
        self, async_engine: Any, model_name: str, registry: CollectorRegistry | None = None
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        self.registry.register(_EngineCollector(async_engine, model_name))
        kw: dict[str, Any] = dict(labelnames=["model_name"], registry=self.registry)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens",
            "Prompt tokens of the requests, prefix-cache hits included.",
            **kw,
        ).labels(model_name)
        self.prompt_tokens_cached = Counter(
            "vllm:prompt_tokens_cached",
            "Prompt tokens whose KV came from the prefix cache.",
            **kw,
        ).labels(model_name)
        self.request_success = Counter(
            "vllm:request_success",
            "Requests (one per prompt) that finished, by the finish reason of their first choice.",
            labelnames=["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            buckets=_LATENCY_BUCKETS,
            **kw,
        ).labels(model_name)
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            buckets=_TPOT_BUCKETS,
            **kw,
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            buckets=_LATENCY_BUCKETS,
            **kw,
        ).labels(model_name)
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Time from arrival to the first step that schedules the request.",
            buckets=_LATENCY_BUCKETS,
            **kw,
        ).labels(model_name)
        self.prefill_time = Histogram(
            "vllm:request_prefill_time_seconds",
            "Time from the first scheduling step to the first generated token.",
            buckets=_LATENCY_BUCKETS,
            **kw,
        ).labels(model_name)

    def observe_prefilled(self, out: RequestOutput) -> None:
        """Count the prompt tokens of a request whose prompt is done (its first output)."""
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.prompt_tokens_cached.inc(out.num_cached_tokens)

    def observe_finished(self, out: RequestOutput) -> None:
        """Count a finished request (``vllm:request_success_total``) and record its latencies."""
        reason = out.outputs[0].finish_reason if out.outputs else None
        self.request_success.labels(self.model_name, reason or "unknown").inc()
        m = out.metrics
        if m is None:
            return
        if m.first_token_time is not None:
            self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
        if m.first_scheduled_time is not None:
            # TTFT = queue time + prefill time (vLLM's split of where a first token waits).
            self.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
            if m.first_token_time is not None:
                self.prefill_time.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
        end = m.finished_time
        if end is None:
            return
        self.e2e.observe(max(0.0, end - m.arrival_time))
        n_tokens = max((len(c.token_ids) for c in out.outputs), default=0)
        if m.first_token_time is not None and n_tokens > 1:
            self.tpot.observe(max(0.0, end - m.first_token_time) / (n_tokens - 1))

    def render(self) -> tuple[bytes, str]:
        """The text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
