"""``pagedllm bench throughput``: offline throughput, the engine in-process (paper section 6).

All requests are given at once; the engine (with the chosen ``kv_manager``) serves them with
continuous batching, each request asking for exactly its output length (greedy, ``ignore_eos``).
Reported: requests/s, output tokens/s and total (prompt + output) tokens/s over the wall time,
and the engine's counters (batched requests per step, memory waste, preemptions).

The peer is transformers' ``generate`` on the same weights with **static batching**: requests in
order, ``batch_size`` at a time, left-padded, each batch generating until its longest request is
done (the others' extra tokens are computed and thrown away; only requested tokens are counted).
A second peer, ``run_transformers_continuous``, is transformers' own continuous batching (the
manager behind ``generate_batch``, with its paged KV cache), each request with its own length.
"""

from __future__ import annotations

import time
from typing import Any

from pagedllm.bench.datasets import BenchRequest, workload_stats


def _token_prompts(requests: list[BenchRequest], tokenize: Any) -> list[list[int]]:
    return [r.prompt if isinstance(r.prompt, list) else tokenize(r.prompt) for r in requests]


def run_pagedllm(
    requests: list[BenchRequest], engine_args: dict[str, Any], progress: bool = True, **llm_kw: Any
) -> dict[str, Any]:
    """Serve ``requests`` with one ``LLM`` built from ``engine_args`` (``EngineConfig`` fields,
    e.g. ``engine_kwargs_from_args(args)``); ``llm_kw`` goes to ``LLM`` too (``loaded=`` a model
    to reuse). Returns the result dict (throughputs in requests/s and tokens/s, engine stats).

    Raises:
        TypeError / ValueError: naming an unknown or invalid engine option.
    """
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    llm = LLM(**engine_args, **llm_kw)
    prompts = _token_prompts(requests, llm.engine.tokenize)
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests
    ]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=progress)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(p) for p in prompts)
    return {
        "backend": "pagedllm",
        "kv_manager": llm.engine.config.kv_manager,
        "num_blocks": llm.engine.num_blocks,
        "block_size": llm.engine.config.block_size,
        "elapsed_s": elapsed,
        "request_throughput": len(requests) / elapsed,
        "output_throughput": n_out / elapsed,
        "total_token_throughput": (n_in + n_out) / elapsed,
        "workload": workload_stats(requests),
        "engine_stats": llm.engine.stats.summary(),
    }


def _hf_model(model: str | None, dtype: str) -> tuple[Any, Any]:
    """transformers' ``LlamaForCausalLM`` with the weights pagedllm loads (same GGUF / folder)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedllm.config import parse_dtype
    from pagedllm.model.loader import hf_config_dict, load_model

    tdtype = parse_dtype(dtype)
    loaded = load_model(model, tdtype)
    hf: Any = LlamaForCausalLM(LlamaConfig(**hf_config_dict(loaded.config)))
    hf = hf.to(tdtype).eval()
    hf.load_state_dict(loaded.state_dict, strict=False)
    hf.tie_weights()
    return hf, loaded.tokenizer


def run_transformers_continuous(
    requests: list[BenchRequest],
    model: str | None = None,
    dtype: str = "float32",
    kv_tokens: int = 8192,
) -> dict[str, Any]:
    """Serve ``requests`` with transformers' continuous batching (``ContinuousBatchingManager``,
    what ``generate_batch`` runs), greedy, each request generating exactly its ``output_len``.
    Its paged KV cache gets ``kv_tokens`` token slots (rounded down to its 256-token pages; by
    default it would size the cache from free device memory).

    Raises:
        RuntimeError: when the manager stops before every request finished (its error included).
    """
    from transformers import ContinuousBatchingConfig, GenerationConfig

    hf, tok = _hf_model(model, dtype)
    prompts = _token_prompts(requests, lambda t: list(tok(t, add_special_tokens=False).input_ids))
    gen = GenerationConfig(
        do_sample=False, max_new_tokens=max(r.output_len for r in requests), pad_token_id=0
    )
    gen.eos_token_id = None  # ignore_eos: every request runs to its own output_len
    n_out = 0
    t0 = time.perf_counter()
    page = ContinuousBatchingConfig.page_size
    cb_cfg = ContinuousBatchingConfig(num_blocks=max(1, kv_tokens // page))
    with hf.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb_cfg, block=True, timeout=5
    ) as m:
        for i, (p, r) in enumerate(zip(prompts, requests, strict=True)):
            m.add_request(p, request_id=str(i), max_new_tokens=r.output_len)
        done = 0
        while done < len(requests):
            res = m.get_result(timeout=1)
            if res is None:
                if not m.is_running():
                    raise RuntimeError(
                        f"transformers continuous batching stopped after {done} requests"
                    )
                continue
            if res.is_finished():
                done += 1
                n_out += len(res.generated_tokens)
    elapsed = time.perf_counter() - t0
    n_in = sum(len(p) for p in prompts)
    return {
        "backend": "transformers-continuous",
        "elapsed_s": elapsed,
        "request_throughput": len(requests) / elapsed,
        "output_throughput": n_out / elapsed,
        "total_token_throughput": (n_in + n_out) / elapsed,
        "workload": workload_stats(requests),
    }


def run_transformers(
    requests: list[BenchRequest],
    model: str | None = None,
    dtype: str = "float32",
    batch_size: int = 8,
    progress: bool = True,
) -> dict[str, Any]:
    """Serve ``requests`` with transformers' ``generate``, static batches of ``batch_size``.

    Raises:
        ValueError: naming ``batch_size`` when it is < 1.
    """
    import torch
    from tqdm.auto import tqdm

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    hf, tok = _hf_model(model, dtype)
    prompts = _token_prompts(requests, lambda t: list(tok(t, add_special_tokens=False).input_ids))
    pad = 0
    n_out = 0
    t0 = time.perf_counter()
    for i in tqdm(range(0, len(requests), batch_size), disable=not progress, desc="transformers"):
        batch = prompts[i : i + batch_size]
        outs = [r.output_len for r in requests[i : i + batch_size]]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(outs),
                min_new_tokens=max(outs),
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=None,
            )
        n_out += sum(outs)
    elapsed = time.perf_counter() - t0
    n_in = sum(len(p) for p in prompts)
    return {
        "backend": "transformers",
        "batch_size": batch_size,
        "elapsed_s": elapsed,
        "request_throughput": len(requests) / elapsed,
        "output_throughput": n_out / elapsed,
        "total_token_throughput": (n_in + n_out) / elapsed,
        "workload": workload_stats(requests),
    }
