"""Offline throughput: pagedllm vs transformers' ``generate`` on the same weights, same run.

Workload (issue 2): ``--num-prompts`` ShareGPT prompts truncated to exactly ``--prompt-len``
tokens, each generating exactly ``--output-len`` tokens (ignore_eos), greedy, same dtype, same
thread count. transformers runs static batching (one ``generate`` call with the whole batch, so
no padding is needed since all prompts have the same length). The systems alternate for
``--rounds`` rounds; the script prints the median output tokens/s of each and their ratio, and
writes JSON to benchmarks/results/.

    .venv/bin/python benchmarks/throughput_vs_transformers.py --rounds 3
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
from common import median, sharegpt_prompts  # noqa: E402


def run_pagedllm(llm, prompts, output_len) -> float:
    from pagedllm.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.reset_prefix_cache()  # each round prefills its prompts, as transformers' generate does
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return len(prompts) * output_len / dt


def run_transformers(model, prompts, output_len) -> float:
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    dt = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + output_len
    return len(prompts) * output_len / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/throughput_vs_transformers.json")
    args = ap.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedllm.entrypoints.llm import LLM
    from pagedllm.model.loader import hf_config_dict, load_model

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    loaded = load_model(None, dtype)
    prompts = sharegpt_prompts(loaded.tokenizer, args.num_prompts, args.prompt_len)
    llm = LLM(
        loaded=loaded,
        dtype=args.dtype,
        max_model_len=args.prompt_len + args.output_len + 16,
        num_threads=args.threads,
    )
    hf = None
    if not args.skip_transformers:
        hf = LlamaForCausalLM(LlamaConfig(**hf_config_dict(loaded.config))).to(dtype).eval()
        hf.load_state_dict(loaded.state_dict, strict=False)
        hf.tie_weights()

    # Warm-up (first-call allocations), not timed.
    run_pagedllm(llm, prompts[:4], 8)
    if hf is not None:
        run_transformers(hf, prompts[:4], 8)

    ours, theirs = [], []
    for r in range(args.rounds):
        ours.append(run_pagedllm(llm, prompts, args.output_len))
        print(f"round {r}: pagedllm     {ours[-1]:7.1f} output tokens/s", flush=True)
        if hf is not None:
            theirs.append(run_transformers(hf, prompts, args.output_len))
            print(f"round {r}: transformers {theirs[-1]:7.1f} output tokens/s", flush=True)
    result = {
        "workload": f"{args.num_prompts} prompts x ({args.prompt_len} in, {args.output_len} out), "
        f"greedy, {args.dtype}, {args.threads} threads",
        "pagedllm_tok_s": ours,
        "transformers_tok_s": theirs,
        "pagedllm_median": median(ours),
        "transformers_median": median(theirs) if theirs else None,
        "ratio": median(ours) / median(theirs) if theirs else None,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    print(json.dumps({k: v for k, v in result.items() if "median" in k or k == "ratio"}, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
