"""Command line: ``pagedllm generate`` (offline batch) and, with the server extra, ``pagedllm serve``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from pagedllm.config import engine_kwargs_from_args as engine_kwargs
from pagedllm.config_cli import add_engine_args

__all__ = ["add_engine_args", "build_parser", "engine_kwargs", "main"]


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """Add the ``SamplingParams`` flags of ``generate`` (``--max-tokens``, ``--temperature``...)."""
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request seed")
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None)


def _read_prompts(args: argparse.Namespace) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = [{"prompt": p} for p in args.prompt or []]
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise SystemExit(f"error: --prompts-file {path} does not exist")
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            if line.strip():
                try:
                    items.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise SystemExit(f"error: {path}:{n}: not JSON: {e}") from e
    if not items:
        raise SystemExit("error: give prompts as arguments (--prompt) or with --prompts-file")
    return items


def cmd_generate(args: argparse.Namespace) -> int:
    """``pagedllm generate``: run the prompts through one ``LLM`` built from the engine flags and
    print each completion and a summary. Returns the exit status (2 for invalid input)."""
    from pagedllm.entrypoints.llm import LLM, apply_chat_template
    from pagedllm.sampling_params import SamplingParams

    items = _read_prompts(args)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            min_tokens=args.min_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.sample_seed,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            repetition_penalty=args.repetition_penalty,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
            logprobs=args.logprobs,
        )
        llm = LLM(**engine_kwargs(args))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tok = llm.get_tokenizer()
    prompts: list[Any] = []
    shown: list[str] = []
    for it in items:
        if "messages" in it:
            prompts.append({"prompt_token_ids": apply_chat_template(tok, it["messages"])})
            shown.append(it["messages"][-1]["content"])
        elif args.chat and "prompt" in it:
            msgs = [{"role": "user", "content": it["prompt"]}]
            prompts.append({"prompt_token_ids": apply_chat_template(tok, msgs)})
            shown.append(it["prompt"])
        else:
            prompts.append(it.get("prompt", it))
            shown.append(str(it.get("prompt", it)))
    t0 = time.perf_counter()
    try:
        outputs = llm.generate(prompts, params, use_tqdm=not args.quiet)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    wall = time.perf_counter() - t0
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    n_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    for i, (o, p) in enumerate(zip(outputs, shown, strict=True)):
        c = o.outputs[0]
        print(f"\n=== [{i}] {p}")
        print(c.text)
        print(f"--- {len(c.token_ids)} tokens, finish_reason={c.finish_reason}")
    st = llm.engine.stats
    print("\n=== summary")
    print(f"requests:                {len(outputs)}")
    print(f"prompt tokens:           {n_in}")
    print(f"output tokens:           {n_out}")
    print(f"wall time:               {wall:.2f} s")
    print(f"output throughput:       {n_out / wall:.1f} tokens/s")
    print(
        f"peak KV blocks in use:   {st.peak_blocks_used} of {llm.engine.num_blocks} "
        f"(block size {llm.engine.config.block_size})"
    )
    print(
        f"KV slots holding tokens: {100 * st.mean_slot_utilization:.1f}% (mean over {st.num_steps} steps)"
    )
    print(f"preemptions:             {st.num_preemptions}")
    return 0


# What `pagedllm --help` shows under the commands: the opt-in features and their flags (every
# engine flag is on generate, serve and bench throughput; see `pagedllm serve --help`).
FEATURES_EPILOG = """\
opt-in features (flags of generate, serve and bench throughput):
  --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
                        speculative decoding, greedy output unchanged (docs/spec_decode.md)
  --quantization {int8,gguf}  lossy weight formats (docs/models.md)
  --kv-cache-dtype {fp8_e4m3,int8}  lossy KV cache, ~4x the tokens (docs/kv_cache_dtype.md)
  -tp N / -pp N         tensor / pipeline parallelism (docs/pipeline_parallel.md)
serve only:
  --admission slots     refuse at once what could not start at the next step (503)
  --data-parallel-size N, --extra-model PATH
                        engine replicas, several models behind one endpoint (docs/scaling.md)
"""


def _package_version() -> str:
    from pagedllm import __version__

    return __version__


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def build_parser() -> argparse.ArgumentParser:
    """The ``pagedllm`` parser: ``generate``, ``serve`` (with the server extra) and ``bench``."""
    parser = argparse.ArgumentParser(
        prog="pagedllm",
        description="LLM serving with PagedAttention",
        epilog=FEATURES_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {_package_version()} (torch {_torch_version()})",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate completions offline for a batch of prompts")
    add_engine_args(g)
    add_sampling_args(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    g.add_argument("--prompts-file", help='JSONL: {"prompt": ...} or {"messages": [...]} per line')
    g.add_argument("--chat", action="store_true", help="apply the chat template to plain prompts")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.set_defaults(func=cmd_generate)

    try:
        from pagedllm.entrypoints.openai.cli_serve import add_serve_parser
    except ImportError:
        pass
    else:
        add_serve_parser(sub)

    from pagedllm.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``pagedllm`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
