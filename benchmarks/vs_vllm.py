"""End-to-end offline throughput: pagedllm vs vLLM's CPU build, same run, same files (issue 6).

Both engines load the same Hugging Face folder (the bundled SmolLM2-135M-Instruct exported once to
``.bench/smollm2-135m-hf``), greedy, ``ignore_eos`` so every request makes exactly its output
length, both on both cores with the same KV budget (``--kv-cache-gib``) and batch limit
(``--max-num-seqs``). ``--dtype`` picks the weights/activations/KV dtype of both: ``float32``,
``bfloat16``, or ``default`` (issue 22): each engine at its own default dtype and kernels,
pagedllm ``dtype="auto"`` (docs/dtype.md: fp32 on AVX2/AVX-512 CPUs, bf16 with AMX-BF16) and
vLLM's ``dtype="auto"`` (bf16 on x86 CPUs); the dtype each engine resolved is printed and
recorded. The CPU (model name and avx2/avx512*/amx* flags) is printed first, since the answer
depends on it. If vLLM fails (e.g. its wheel needs an instruction this CPU lacks), the error
names the exit status or signal and the CPU flags, and pagedllm's rounds still run. vLLM runs in its own venv (``vllm_cpu.py`` installs it) as a
subprocess, pagedllm in this process; the two alternate round by round and the script prints
each engine's output tokens/s, the medians and the ratio. Engine start-up, torch.compile and a
small warm-up are not timed. Each round of both engines starts with an empty prefix cache
(before 2026-11-30 pagedllm's later rounds found the prompts of the earlier ones cached and
skipped most of their prefill, which inflated its second-round figures).

It then replays the linear layers alone of every step of pagedllm's first round
(``linears_floor.py``) and prints that floor as output tokens/s, each engine's share of it and
the ratio over vLLM an engine would show if everything but its matmuls were free. (vLLM batches
its steps its own way, so its GEMM shapes differ a little; the floor is pagedllm's.)

Workloads:
  a: 64 ShareGPT prompts cut to exactly 100 tokens, 128 output tokens each.
  b: 512 ShareGPT requests with their reference output lengths (first human turn as prompt,
     reply token count as output length; requests with prompt > 1024 or prompt + output > 2048
     tokens, or either under 4 tokens, are skipped, as in vLLM's own ShareGPT benchmark).

    .venv/bin/python benchmarks/vs_vllm.py --workload a --rounds 3 --dtype default
    .venv/bin/python benchmarks/vs_vllm.py --workload b --rounds 1 --dtype default
    .venv/bin/python benchmarks/vs_vllm.py --workload a --rounds 3 --dtype float32
"""

from __future__ import annotations

import pagedllm  # noqa: F401 (first: it sets OpenMP's barrier spin before torch loads libgomp)

# isort: split
import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

from pagedllm.platform import AUTO_DTYPE_ENV

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    bench_lock,
    cpu_description,
    dataset_requests,
    median,
    merge_json,
    sharegpt_prompts,
)
from linears_floor import StepShapes, workload_floor_s  # noqa: E402
from vllm_cpu import VllmFailed, export_model, run_offline  # noqa: E402

# --dtype -> (pagedllm's dtype, vLLM's dtype); "auto" is each engine's own default.
DTYPES = {
    "float32": ("float32", "float32"),
    "bfloat16": ("bfloat16", "bfloat16"),
    "default": ("auto", "auto"),
}


def workload_requests(name: str, tokenizer, num: int | None = None) -> list[dict]:
    """Requests of workload ``name`` as ``{"prompt_token_ids", "max_tokens"}`` dicts; ``num``
    requests (default: the workload's own count, 64 for a and 512 for b)."""
    if name == "a":
        prompts = sharegpt_prompts(tokenizer, num or 64, 100)
        return [{"prompt_token_ids": p, "max_tokens": 128} for p in prompts]
    return [
        {"prompt_token_ids": p, "max_tokens": n}
        for p, n in dataset_requests(tokenizer, "sharegpt", num or 512)
    ]


def run_pagedllm(llm, reqs: list[dict]) -> dict:
    from pagedllm.sampling_params import SamplingParams

    params = [
        SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs
    ]
    # Every round starts with an empty prefix cache, as vLLM's does (a fresh process per round):
    # otherwise a repeated round finds its prompts cached and skips their prefill.
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(
        [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs], params, use_tqdm=False
    )
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "output_tok_s": n_out / elapsed,
        "elapsed_s": elapsed,
        "num_output_tokens": n_out,
        "first_output": list(outs[0].outputs[0].token_ids[:16]),
        "preemptions": llm.engine.stats.num_preemptions if hasattr(llm.engine, "stats") else None,
    }


def main() -> None:
    # SIGTERM unwinds like Ctrl-C, so the vLLM process group is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=["a", "b"], default="a")
    ap.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="default",
        help="both engines' dtype; default = each engine's own (pagedllm auto, vLLM auto)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="request count (default: the workload's, 64 for a, 512 for b; fewer for a smoke run)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-gib", type=int, default=4, help="KV pool of both engines")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument(
        "--block-size",
        type=int,
        default=64,
        help="pagedllm's KV block size in tokens (default 64: on this CPU the decode attention "
        "reads 64-token blocks 8-37%% faster than 16-token ones, docs/benchmarks.md; vLLM keeps "
        "its CPU default, 128)",
    )
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument(
        "--no-lock",
        action="store_true",
        help="do not wait for the machine-wide benchmark lock (smoke runs; figures are then noisy)",
    )
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM without torch.compile")
    ap.add_argument("--out", default="benchmarks/results/vs_vllm.json")
    args = ap.parse_args()

    from pagedllm.entrypoints.llm import LLM

    torch.set_num_threads(args.threads)
    ours_dtype, vllm_dtype = DTYPES[args.dtype]
    cpu = cpu_description()
    print(f"CPU: {cpu}", flush=True)
    if ours_dtype == "auto" and os.environ.get(AUTO_DTYPE_ENV):
        print(f"note: {AUTO_DTYPE_ENV}={os.environ[AUTO_DTYPE_ENV]} overrides pagedllm's auto rule")
    model_dir = export_model()
    max_model_len = 2048 if args.workload == "b" else 256
    llm = LLM(
        model=str(model_dir),
        max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory=args.kv_cache_gib * 2**30,
        num_threads=args.threads,
        block_size=args.block_size,
        dtype=ours_dtype,
    )
    ours_resolved = str(llm.engine.config.torch_dtype).replace("torch.", "")
    reqs = workload_requests(args.workload, llm.get_tokenizer(), args.num_requests)
    n_in = sum(len(r["prompt_token_ids"]) for r in reqs)
    n_out = sum(r["max_tokens"] for r in reqs)
    desc = (
        f"workload {args.workload}: {len(reqs)} requests, {n_in / len(reqs):.0f} prompt / "
        f"{n_out / len(reqs):.0f} output tokens on average, --dtype {args.dtype} (pagedllm "
        f"{ours_resolved}), greedy, {args.threads} threads, "
        f"pagedllm block size {args.block_size}"
    )
    print(desc, flush=True)
    vllm_wl = {
        "model": str(model_dir),
        "dtype": vllm_dtype,
        "max_model_len": max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "enforce_eager": args.vllm_eager,
        "requests": reqs,
    }
    ours: list[dict] = []
    theirs: list[dict] = []
    vllm_error: str | None = "skipped (--skip-vllm)" if args.skip_vllm else None
    with contextlib.nullcontext() if args.no_lock else bench_lock():
        run_pagedllm(llm, [dict(r, max_tokens=8) for r in reqs[:8]])  # warm-up
        shapes: list[tuple[int, int]] = []
        for r in range(args.rounds):
            recorder = StepShapes(llm.engine)
            ours.append(run_pagedllm(llm, reqs))
            recorder.detach()
            shapes = shapes or recorder.shapes  # the first round's steps
            print(f"round {r}: pagedllm  {ours[-1]['output_tok_s']:7.1f} output tok/s", flush=True)
            if vllm_error is None:
                try:
                    theirs.append(run_offline(vllm_wl, kv_cache_gib=args.kv_cache_gib))
                except VllmFailed as e:  # reported, and pagedllm's rounds go on
                    vllm_error = str(e)
                    print(f"round {r}: {vllm_error}", flush=True)
                    continue
                t = theirs[-1]
                print(
                    f"round {r}: vllm-cpu  {t['output_tok_s']:7.1f} output tok/s ({t.get('dtype')})",
                    flush=True,
                )
        # The same steps with only their linear layers: the time if all else were free.
        floor_s = workload_floor_s(llm.engine.executor.worker.model, shapes)
    ours_med = median([o["output_tok_s"] for o in ours])
    theirs_med = median([t["output_tok_s"] for t in theirs]) if theirs else None
    floor_tok_s = n_out / floor_s
    result = {
        "workload": desc,
        "cpu": cpu,
        "dtype_mode": args.dtype,
        "pagedllm_dtype": ours_resolved,
        "vllm_dtype": theirs[0].get("dtype") if theirs else None,
        "vllm_error": vllm_error,
        "pagedllm": ours,
        "vllm_cpu": theirs,
        "pagedllm_median_tok_s": ours_med,
        "vllm_median_tok_s": theirs_med,
        "ratio": ours_med / theirs_med if theirs_med else None,
        "linears_floor_s": floor_s,
        "linears_floor_tok_s": floor_tok_s,
        "pagedllm_share_of_floor": ours_med / floor_tok_s,
        "vllm_share_of_floor": theirs_med / floor_tok_s if theirs_med else None,
        "highest_possible_ratio": floor_tok_s / theirs_med if theirs_med else None,
        "same_first_tokens": (ours[0]["first_output"] == theirs[0]["first_output"])
        if theirs
        else None,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    print(
        json.dumps({k: v for k, v in result.items() if k not in ("pagedllm", "vllm_cpu")}, indent=1)
    )
    # workload_<w> is the latest run (ab_revisions.py reads it); workload_<w>_<dtype> keeps each mode.
    key = f"workload_{args.workload}"
    merge_json(args.out, {key: result, f"{key}_{args.dtype}": result})


if __name__ == "__main__":
    main()
