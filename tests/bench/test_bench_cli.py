"""``pagedllm bench`` output: quiet httpx logs, the KV memory breakdown's labels, the
speculative decoding figures."""

import logging

from pagedllm.entrypoints.cli import build_parser


def test_bench_serve_quiets_httpx(monkeypatch):
    parser = build_parser()
    from pagedllm.bench import cli as bench_cli

    def no_data(args, tokenizer):
        raise ValueError("no data")

    monkeypatch.setattr(bench_cli, "build_requests", no_data)
    monkeypatch.setattr(bench_cli, "_load_tokenizer", lambda name: None)
    for name in ("httpx", "httpcore"):
        monkeypatch.setattr(logging.getLogger(name), "level", logging.INFO)
    args = parser.parse_args(["bench", "serve", "--dataset", "random"])
    assert args.func(args) == 2
    assert logging.getLogger("httpx").level == logging.WARNING
    assert logging.getLogger("httpcore").level == logging.WARNING


def test_kv_memory_line_calls_the_useful_share_token_states():
    from pagedllm.bench.cli import kv_memory_line

    line = kv_memory_line(
        {
            "memory_waste": {
                "token_states": 0.75,
                "reserved": 0.1,
                "internal_fragmentation": 0.05,
                "external_fragmentation": 0.1,
            }
        }
    )
    assert "token states 75.0% (useful)" in line and "waste" not in line


def test_spec_decode_line_gives_acceptance_and_mean_accepted_length():
    from pagedllm.engine.stats import EngineStats

    st = EngineStats(spec_num_drafts=4, spec_draft_tokens=12, spec_accepted_tokens=6,
                     spec_accepted_per_pos=[3, 2, 1], spec_draft_per_pos=[4, 4, 4]).summary()
    assert EngineStats.from_summary(st).spec_decode_line() == (
        "speculative decoding: acceptance 50.0% (6 of 12 draft tokens), mean accepted length "
        "2.50, per position [0.75, 0.50, 0.25]"
    )
    assert EngineStats().spec_decode_line() is None
