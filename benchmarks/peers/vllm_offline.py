"""Offline throughput of vLLM's CPU build on a workload file; runs under .bench/vllm-venv.

Called by ``benchmarks/vllm_cpu.py:run_offline``. The workload JSON holds ``model`` (a Hugging Face
folder), ``dtype`` (``"auto"`` = vLLM's own default), ``max_model_len``, ``max_num_seqs``, optional ``max_num_batched_tokens`` and
``enforce_eager``, and ``requests``: ``[{"prompt_token_ids": [...], "max_tokens": n}]``. Every
request is greedy with ``ignore_eos`` so it makes exactly ``max_tokens`` tokens. One untimed
warm-up (8 requests x 8 tokens, which also triggers torch.compile), an emptied prefix cache,
then one timed ``generate`` over all requests; writes ``{"output_tok_s", "elapsed_s", "num_output_tokens", "dtype", ...}`` to ``--out``
(``dtype``: the one vLLM resolved and ran).
"""

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with open(args.workload) as f:
        wl = json.load(f)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t_load = time.perf_counter()
    kwargs = dict(
        model=wl["model"],
        dtype=wl.get("dtype", "float32"),
        max_model_len=wl["max_model_len"],
        max_num_seqs=wl.get("max_num_seqs", 256),
        enforce_eager=wl.get("enforce_eager", False),
        seed=0,
    )
    if wl.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = wl["max_num_batched_tokens"]
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t_load
    model_config = getattr(llm.llm_engine, "model_config", None)
    resolved_dtype = str(getattr(model_config, "dtype", kwargs["dtype"])).replace("torch.", "")

    reqs = wl["requests"]
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in reqs]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs
    ]
    llm.generate(
        prompts[:8], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    llm.reset_prefix_cache()  # the timed run starts cold, as pagedllm's rounds do
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {
        "engine": "vllm-cpu",
        "output_tok_s": n_out / elapsed,
        "elapsed_s": elapsed,
        "num_output_tokens": n_out,
        "num_requests": len(reqs),
        "load_s": load_s,
        "dtype": resolved_dtype,
        "settings": {k: v for k, v in kwargs.items() if k != "model"},
        "first_output": list(outs[0].outputs[0].token_ids[:16]),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(
        json.dumps(
            {k: result[k] for k in ("output_tok_s", "elapsed_s", "num_output_tokens", "dtype")}
        )
    )


if __name__ == "__main__":
    main()
