"""Speculative-decoding counters: EngineStats properties, deltas and the /metrics families."""

from prometheus_client.core import CounterMetricFamily

from pagedllm.engine.stats import EngineStats
from pagedllm.entrypoints.openai.metrics import _EngineCollector


def test_stats_properties_and_delta():
    st = EngineStats(spec_num_drafts=4, spec_draft_tokens=12, spec_accepted_tokens=6,
                     spec_accepted_per_pos=[3, 2, 1], spec_draft_per_pos=[4, 4, 4])
    assert st.spec_acceptance_rate == 0.5
    assert st.spec_mean_accepted_length == 2.5
    before = EngineStats(spec_num_drafts=1, spec_draft_tokens=3, spec_accepted_tokens=1,
                         spec_accepted_per_pos=[1], spec_draft_per_pos=[1, 1]).summary()
    d = EngineStats.delta(before, st.summary())
    assert (d.spec_num_drafts, d.spec_draft_tokens, d.spec_accepted_tokens) == (3, 9, 5)
    assert d.spec_accepted_per_pos == [2, 2, 1] and d.spec_draft_per_pos == [3, 3, 4]
    assert EngineStats().spec_acceptance_rate == 0.0 == EngineStats().spec_mean_accepted_length


def test_metric_families_use_vllm_names():
    st = EngineStats(spec_num_drafts=2, spec_draft_tokens=8, spec_accepted_tokens=5,
                     spec_accepted_per_pos=[2, 2, 1, 0], spec_draft_per_pos=[2, 2, 2, 2])

    def counter(name, doc, value):
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric(["m"], value)
        return c

    fams = list(_EngineCollector(None, "m")._spec_decode_metrics(st, counter))
    got = {s.name: (s.labels, s.value) for f in fams for s in f.samples}
    assert got["vllm:spec_decode_num_drafts_total"] == ({"model_name": "m"}, 2)
    assert got["vllm:spec_decode_num_draft_tokens_total"] == ({"model_name": "m"}, 8)
    assert got["vllm:spec_decode_num_accepted_tokens_total"] == ({"model_name": "m"}, 5)
    per_pos = [s for f in fams for s in f.samples if s.name.endswith("per_pos_total")]
    assert [(s.labels["position"], s.value) for s in per_pos] == [("0", 2), ("1", 2), ("2", 1), ("3", 0)]
