"""``pagedllm bench throughput`` and ``pagedllm bench serve``: argument parsing and JSON output."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

from pagedllm.bench.datasets import (
    DATASETS,
    FILES,
    SOURCES,
    BenchRequest,
    hf_tokenize,
    load_dataset,
)
from pagedllm.config import engine_kwargs_from_args
from pagedllm.config_cli import add_engine_args


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    """Add the workload flags of ``bench throughput`` and ``bench serve``."""
    p.add_argument(
        "--dataset",
        "--dataset-name",
        default="sharegpt",
        choices=list(DATASETS),
        help="workload (default sharegpt); random = random token ids, needs no file",
    )
    p.add_argument(
        "--dataset-path",
        default=None,
        metavar="FILE",
        help="the dataset's JSON file: for sharegpt "
        + SOURCES["sharegpt"]
        + "; for alpaca "
        + SOURCES["alpaca"]
        + "; for wmt16 "
        + SOURCES["wmt16"]
        + f" (default: --data-dir/{FILES['sharegpt']}, {FILES['alpaca']} or {FILES['wmt16']})",
    )
    p.add_argument(
        "--data-dir",
        default=None,
        help="folder of the development samples, under their default names (default "
        "$PAGEDLLM_DATA, else ../shared/data next to the repository)",
    )
    p.add_argument("--num-prompts", type=int, default=100, help="requests in the run")
    p.add_argument("--dataset-seed", type=int, default=0, help="which records are sampled")
    p.add_argument("--max-prompt-len", type=int, default=1024, help="drop longer prompts (tokens)")
    p.add_argument(
        "--max-total-len", type=int, default=2048, help="drop prompt + output over this (tokens)"
    )
    p.add_argument("--max-output-len", type=int, default=None, help="cap output lengths (tokens)")
    p.add_argument("--wmt-shots", type=int, default=1, help="WMT16 translation examples")
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--output", default=None, help="write the result as JSON here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def build_requests(args: argparse.Namespace, tokenizer: Any) -> list[BenchRequest]:
    """The workload the dataset flags describe, lengths counted with ``tokenizer``.

    Raises:
        ValueError: naming the flag's field for an invalid value, or when no record is usable.
        FileNotFoundError: when the dataset file is missing (the message says where to get it).
    """
    reqs = load_dataset(
        args.dataset,
        hf_tokenize(tokenizer),
        args.num_prompts,
        data_dir=args.data_dir,
        dataset_path=args.dataset_path,
        seed=args.dataset_seed,
        max_prompt_len=args.max_prompt_len,
        max_model_len=args.max_total_len,
        max_output_len=args.max_output_len,
        wmt_shots=args.wmt_shots,
        input_len=args.random_input_len,
        output_len=args.random_output_len,
        vocab_size=len(tokenizer),
    )
    if not reqs:
        raise ValueError(f"dataset: no usable {args.dataset} records")
    return reqs


def _write(result: dict[str, Any], path: str | None) -> None:
    text = json.dumps(result, indent=1)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
        print(f"wrote {path}", file=sys.stderr)


def _load_tokenizer(model: str | None) -> Any:
    from pagedllm.model.loader.load import resolve_model_path
    from pagedllm.model.loader.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_path(model)[0])


def kv_memory_line(st: dict[str, Any]) -> str:
    """The engine's KV memory breakdown, averaged over steps: the share holding token states
    (useful) and the shares lost to reservation, internal and external fragmentation (paper
    figure 2)."""
    w = st["memory_waste"]
    return (
        f"KV memory: token states {100 * w['token_states']:.1f}% (useful), reserved "
        f"{100 * w['reserved']:.1f}%, internal frag {100 * w['internal_fragmentation']:.1f}%, "
        f"external frag {100 * w['external_fragmentation']:.1f}%"
    )


def cmd_throughput(args: argparse.Namespace) -> int:
    """``bench throughput``: serve the workload in-process and print / write the result."""
    from pagedllm.bench.throughput import (
        run_pagedllm,
        run_transformers,
        run_transformers_continuous,
    )

    try:
        reqs = build_requests(args, _load_tokenizer(args.model))
        if args.backend == "transformers":
            result = run_transformers(
                reqs, args.model, args.dtype, args.hf_batch_size, progress=not args.quiet
            )
        elif args.backend == "transformers-continuous":
            blocks = args.num_gpu_blocks_override
            kw = {"kv_tokens": blocks * args.block_size} if blocks else {}
            result = run_transformers_continuous(reqs, args.model, args.dtype, **kw)
        else:
            result = run_pagedllm(reqs, engine_kwargs_from_args(args), progress=not args.quiet)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result.update(dataset=args.dataset, date=time.strftime("%Y-%m-%d %H:%M"))
    st = result.get("engine_stats") or {}
    print(
        f"{result['backend']}: {result['request_throughput']:.3f} requests/s, "
        f"{result['output_throughput']:.1f} output tokens/s, "
        f"{result['total_token_throughput']:.1f} total tokens/s over {result['elapsed_s']:.1f} s"
    )
    if st:
        print(
            f"batched requests/step {st['mean_batched_requests']:.2f}; {kv_memory_line(st)}; "
            f"preemptions {st['num_preemptions']}"
        )
        from pagedllm.engine.stats import EngineStats

        spec = EngineStats.from_summary(st).spec_decode_line()
        if spec is not None:
            print(spec)
    _write(result, args.output)
    return 0


def _rate(text: str) -> float:
    rate = math.inf if text.lower() == "inf" else float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 or inf, got {text}")
    return rate


def cmd_serve(args: argparse.Namespace) -> int:
    """``bench serve``: send the workload to a running server and print / write the result."""
    from pagedllm.bench.serve import run_serve_bench

    # httpx logs every request at INFO, which would scroll through the progress bar.
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        reqs = build_requests(args, _load_tokenizer(args.tokenizer))
        result = asyncio.run(
            run_serve_bench(
                args.base_url,
                reqs,
                model=args.model,
                request_rate=args.request_rate,
                max_concurrency=args.max_concurrency,
                seed=args.seed,
                api_key=args.api_key,
                timeout=args.timeout,
                progress=not args.quiet,
            )
        )
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result.update(dataset=args.dataset, date=time.strftime("%Y-%m-%d %H:%M"))
    print_serve_summary(result)
    _write(result, args.output)
    return 0


def print_serve_summary(r: dict[str, Any]) -> None:
    """Print a ``bench serve`` result: throughput, latency percentiles, engine counters."""

    def ms(d: dict[str, Any], k: str) -> str:
        v = d.get(k)
        return "-" if v is None else f"{1000 * v:.1f}"

    print(
        f"requests: {r['completed']} completed, {r['failed']} failed in {r['duration_s']:.1f} s; "
        f"{r['request_throughput']:.3f} requests/s, {r['output_throughput']:.1f} output tokens/s"
    )
    for name, key in (
        ("TTFT (ms)", "ttft_s"),
        ("TPOT (ms)", "tpot_s"),
        ("e2e latency (ms)", "e2e_latency_s"),
        ("normalized latency (ms/token)", "normalized_latency_s_per_token"),
    ):
        d = r[key]
        print(
            f"{name:31s} mean {ms(d, 'mean')}  p50 {ms(d, 'p50')}  p90 {ms(d, 'p90')}  "
            f"p99 {ms(d, 'p99')}"
        )
    if r["errors"]:
        print(f"errors: {r['errors']}")
    st = r.get("engine_stats")
    if st:
        print(
            f"engine ({st['kv_manager']}): batched requests/step {st['mean_batched_requests']:.2f}, "
            f"{kv_memory_line(st)}, free blocks after {st['num_free_blocks_after']}/"
            f"{st['num_blocks']}"
        )


def add_bench_parser(subparsers: Any) -> None:
    """Add ``bench throughput`` (every engine flag, ``add_engine_args``) and ``bench serve`` to
    the ``pagedllm`` command."""
    bench = subparsers.add_parser("bench", help="benchmarks of the paper's section 6")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    t = sub.add_parser("throughput", help="offline throughput, engine in-process")
    add_engine_args(t)
    add_dataset_args(t)
    t.add_argument(
        "--backend",
        default="pagedllm",
        choices=["pagedllm", "transformers", "transformers-continuous"],
        help="transformers: generate with static batches; transformers-continuous: its generate_batch "
        "manager (continuous batching, paged KV)",
    )
    t.add_argument("--hf-batch-size", type=int, default=8, help="transformers static batch size")
    t.set_defaults(func=cmd_throughput)

    s = sub.add_parser("serve", help="online client (Poisson arrivals) against an OpenAI server")
    add_dataset_args(s)
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (no /v1)")
    s.add_argument("--model", default=None, help="model field (default: first of /v1/models)")
    s.add_argument(
        "--tokenizer", default=None, help="tokenizer for the lengths (default: bundled model)"
    )
    s.add_argument(
        "--request-rate", type=_rate, default=math.inf, help="requests/s (Poisson); inf = burst"
    )
    s.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    s.add_argument("--seed", type=int, default=0, help="seeds the arrival times")
    s.add_argument("--api-key", default=None)
    s.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    s.set_defaults(func=cmd_serve)
