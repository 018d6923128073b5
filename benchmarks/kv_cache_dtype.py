"""KV cache dtypes side by side (issue 22 item 5): capacity, decode speed and quality.

For each ``--kv-cache-dtypes`` entry, on the bundled model (fp32 weights and activations):

- capacity: blocks and tokens at the default ``kv_cache_memory`` (1 GiB) and tokens per GiB;
- decode: ``--batch`` ShareGPT prompts of ``--prompt-len`` tokens prefilled, then the median
  ``LLMEngine.step`` time over ``--steps`` all-decode steps, as output tokens/s;
- quality: teacher-forced perplexity of ``--nll-texts`` held-out ShareGPT replies (the last
  records' "gpt" turns, ``--nll-len`` tokens each; prompt log-probabilities, so every token's
  attention reads the quantized cache), and the share of greedy tokens equal to the first
  dtype's (``--greedy-prompts`` prompts x ``--greedy-tokens`` tokens);
- memory-bound serving (``--sharegpt N``, 0 skips it): the first N ShareGPT requests of
  ``dataset_requests`` (reference output lengths, greedy, ``ignore_eos``) run to the end in a
  small pool (``--pool-mib``, the same bytes for every dtype), with the wall time, output tokens/s,
  mean and peak running sequences per step and preemptions: a KV dtype with more tokens per byte
  batches more requests in the same pool and should finish sooner.

    .venv/bin/python benchmarks/kv_cache_dtype.py --batch 32 --steps 10
    .venv/bin/python benchmarks/kv_cache_dtype.py --kv-cache-dtypes float32,int8,fp8_e4m3 \
        --steps 0 --nll-texts 0 --greedy-prompts 0 --sharegpt 64 --pool-mib 128
"""

from __future__ import annotations

import pagedllm  # noqa: F401 (first: it sets OpenMP's barrier spin before torch loads libgomp)

# isort: split
import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    bench_lock,
    dataset_requests,
    held_out_texts,
    median,
    merge_json,
    sharegpt_prompts,
)


def run_all(engine, prompts: list[list[int]], sp) -> list:
    """Submit ``prompts`` and step until done; outputs in prompt order."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[int(o.request_id)] = o
    return [done[i] for i in range(len(prompts))]


def decode_tokens_per_s(engine, prompts: list[list[int]], steps: int) -> float:
    from pagedllm.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"d{i}", p, sp)
    while engine.scheduler.waiting or any(
        len(s.output_token_ids) == 0 for g in engine.scheduler.running for s in g.seqs
    ):
        engine.step()
    engine.step()  # first all-decode step, warm
    ms = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        ms.append((time.perf_counter() - t0) * 1e3)
    while engine.has_unfinished_requests():
        engine.step()
    return len(prompts) / median(ms) * 1e3


def perplexity(engine, texts: list[list[int]]) -> float:
    """Teacher-forced perplexity of ``texts`` (prompt log-probabilities: every token's attention
    reads the engine's KV cache in its dtype)."""
    from pagedllm.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    nll, n = 0.0, 0
    for text, o in zip(texts, run_all(engine, texts, sp), strict=True):
        for t, pos in zip(text[1:], o.prompt_logprobs[1:], strict=True):
            nll -= pos[t].logprob
            n += 1
    return math.exp(nll / n)


def memory_bound_run(engine, reqs: list[tuple[list[int], int]]) -> dict:
    """Run ``reqs`` (prompt token ids, output length) to the end on ``engine`` (greedy,
    ``ignore_eos``); returns wall seconds, output tokens/s, the mean and peak number of running
    sequences over the steps, and the engine's preemption count."""
    from pagedllm.sampling_params import SamplingParams

    for i, (prompt, n) in enumerate(reqs):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        engine.add_request(f"m{i}", prompt, sp)
    running: list[int] = []
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        running.append(sum(len(g.seqs) for g in engine.scheduler.running))
    wall = time.perf_counter() - t0
    out_tokens = sum(n for _, n in reqs)
    return {
        "wall_s": round(wall, 2),
        "output_tok_s": round(out_tokens / wall, 1),
        "mean_running": round(sum(running) / len(running), 2),
        "peak_running": max(running),
        "steps": len(running),
        "preemptions": engine.scheduler.num_preemptions,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv-cache-dtypes", default="float32,bfloat16,int8,fp8_e4m3")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--nll-texts", type=int, default=8)
    ap.add_argument("--nll-len", type=int, default=256)
    ap.add_argument("--greedy-prompts", type=int, default=8)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sharegpt", type=int, default=0, help="memory-bound run: request count")
    ap.add_argument("--pool-mib", type=int, default=128, help="memory-bound run: KV pool MiB")
    ap.add_argument(
        "--no-lock",
        action="store_true",
        help="do not wait for the machine-wide benchmark lock (the decode figures are then noisy)",
    )
    ap.add_argument("--out", default="benchmarks/results/kv_cache_dtype.json")
    args = ap.parse_args()

    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.model.loader import load_model
    from pagedllm.platform import cpu_flags
    from pagedllm.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    loaded = load_model(None, torch.float32)
    tok = loaded.tokenizer
    decode_prompts = sharegpt_prompts(tok, args.batch, args.prompt_len)
    texts = (
        held_out_texts(tok, args.nll_texts, args.nll_len, args.nll_len) if args.nll_texts else []
    )
    greedy_prompts = decode_prompts[: args.greedy_prompts]
    served = dataset_requests(tok, "sharegpt", args.sharegpt) if args.sharegpt else []
    print(f"CPU flags: {cpu_flags().summary()}; threads {args.threads}")
    results: dict[str, dict] = {}
    ref_tokens: list[list[int]] | None = None
    with contextlib.nullcontext() if args.no_lock else bench_lock():
        for name in args.kv_cache_dtypes.split(","):
            cfg = EngineConfig(
                dtype="float32",
                kv_cache_dtype=name,
                max_model_len=max(args.prompt_len + args.steps, args.nll_len) + 64,
                num_threads=args.threads,
                max_num_seqs=max(args.batch, 1),
            )
            engine = LLMEngine(cfg, loaded=loaded)
            r = results[name] = {
                "num_blocks": engine.num_blocks,
                "block_bytes": engine.block_bytes,
                "tokens_per_gib": engine.kv_tokens_per_gib,
            }
            if args.steps:
                tps = decode_tokens_per_s(engine, decode_prompts, args.steps)
                r[f"decode_tok_s_batch{args.batch}"] = round(tps, 1)
            if texts:
                r["perplexity"] = round(perplexity(engine, texts), 4)
            if greedy_prompts:
                gsp = SamplingParams(temperature=0, max_tokens=args.greedy_tokens, ignore_eos=True)
                toks = [o.outputs[0].token_ids for o in run_all(engine, greedy_prompts, gsp)]
                ref_tokens = ref_tokens or toks
                pairs = zip(ref_tokens, toks, strict=True)
                same = sum(a == b for ref, got in pairs for a, b in zip(ref, got, strict=True))
                r["greedy_agreement"] = round(same / sum(len(x) for x in ref_tokens), 4)
            del engine
            if served:
                small = EngineConfig(
                    dtype="float32",
                    kv_cache_dtype=name,
                    kv_cache_memory=args.pool_mib << 20,
                    max_model_len=2048,
                    num_threads=args.threads,
                )
                engine = LLMEngine(small, loaded=loaded)
                r[f"sharegpt{args.sharegpt}_pool{args.pool_mib}mib"] = {
                    "pool_tokens": engine.num_blocks * small.block_size,
                    **memory_bound_run(engine, served),
                }
                del engine
            print(name, json.dumps(r), flush=True)
    if texts:
        base = results[args.kv_cache_dtypes.split(",")[0]]["perplexity"]
        for r in results.values():
            r["perplexity_vs_first"] = round(r["perplexity"] / base - 1, 4)
    summary = {
        "results": results,
        "batch": args.batch,
        "threads": args.threads,
        "nll_tokens_per_dtype": sum(len(t) - 1 for t in texts),
        "cpu_flags": cpu_flags().summary(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    print(json.dumps(summary, indent=1))
    merge_json(args.out, summary)


if __name__ == "__main__":
    main()
