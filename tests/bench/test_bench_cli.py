"""``pagedllm bench`` output: quiet httpx logs, the KV memory breakdown's labels."""

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
