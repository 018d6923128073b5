"""A token's logprobs do not depend on the path that computed them: decoded alone, in a batch,
prefilled again after recompute preemption, swapped out and in, prefilled in chunks, or
verified with speculative drafts, every reported logprob is the same float, for float32, for
int8 W8A8 weights (whose activation quantization turns any last-bit difference of the
attention into a different rounding step) and for bf16 on the own GEMM's bf16 panels (the fused
layers; CPUs with AVX512-BF16). This rests on the prefill and decode attention
kernels sharing one order of arithmetic (tests/attention/test_decode_prefill_identity.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedllm.sampling_params import SamplingParams

# A 32-token shared prefix with repeated n-grams (the n-gram proposer has something to propose)
# and an 8-token suffix per request.
PREFIX = [10, 11, 12, 13] * 8
PROMPTS = [PREFIX + list(range(100 + 8 * i, 108 + 8 * i)) for i in range(4)]
PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=3)
PATHS: dict[str, dict[str, Any]] = {
    "batched": {},
    "recompute": {"num_gpu_blocks_override": 8, "preemption_mode": "recompute"},
    "swap": {"num_gpu_blocks_override": 8, "preemption_mode": "swap"},
    "chunked_prefill": {"enable_chunked_prefill": True, "max_num_batched_tokens": 24},
    "ngram_spec": {
        "speculative_config": {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 2,
            "learn_step_cost": False,
        }
    },
}


def _tokens_and_logprobs(outputs: list[Any]) -> list[list[tuple[int, dict[int, float]]]]:
    return [
        [
            (tok, {t: lp.logprob for t, lp in step.items()})
            for tok, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)
        ]
        for o in outputs
    ]


@pytest.fixture(scope="module", params=["float32", "int8", "bfloat16"])
def weights(request):
    if request.param == "bfloat16":
        from pagedllm.model.packed_linear import cpu_gemm_ops
        from pagedllm.ops import load_cpu_ops

        if cpu_gemm_ops(load_cpu_ops(), torch.bfloat16) is None:
            pytest.skip("bf16 rows are path-independent on the own GEMM's bf16 panels only "
                        "(avx512 kernel variant, a CPU with avx512_bf16 and no amx_bf16)")
    return request.param


def _weights_kwargs(weights: str) -> dict[str, Any]:
    if weights == "bfloat16":
        return {"dtype": "bfloat16"}
    return {"quantization": None if weights == "float32" else weights}


@pytest.fixture(scope="module")
def alone(tiny_loaded, weights):
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(loaded=tiny_loaded, block_size=16, max_model_len=96, kv_cache_memory=1 << 22,
              enable_prefix_caching=False, **_weights_kwargs(weights))  # fmt: skip
    return [_tokens_and_logprobs(llm.generate([p], PARAMS, use_tqdm=False))[0] for p in PROMPTS]


@pytest.mark.parametrize("path", list(PATHS))
def test_logprobs_bitwise_equal_on_every_path(tiny_llm_factory, alone, weights, path):
    llm = tiny_llm_factory(
        block_size=16, max_model_len=96, enable_prefix_caching=False,
        **_weights_kwargs(weights), **PATHS[path],
    )  # fmt: skip
    got = _tokens_and_logprobs(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    assert got == alone
    sched = llm.engine.scheduler
    if path in ("recompute", "swap"):
        assert sched.preemptions_by_mode[path] > 0
    if path == "ngram_spec":
        assert llm.engine.stats.spec_accepted_tokens > 0


def test_prompt_logprobs_equal_the_sampled_logprobs(tiny_llm_factory):
    """A prompt token's logprob (``prompt_logprobs``, echo) is the same float as that token's
    logprob when it was sampled: the prompt built from a greedy output is scored again."""
    llm = tiny_llm_factory(block_size=16, max_model_len=96, enable_prefix_caching=False)
    out = llm.generate([PROMPTS[0]], PARAMS, use_tqdm=False)[0]
    gen = out.outputs[0]
    again = llm.generate(
        [{"prompt_token_ids": PROMPTS[0] + gen.token_ids}],
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3),
        use_tqdm=False,
    )[0]
    start = len(PROMPTS[0])
    for j, (tok, step) in enumerate(zip(gen.token_ids, gen.logprobs, strict=True)):
        scored = again.prompt_logprobs[start + j]
        assert {t: lp.logprob for t, lp in scored.items()} == {
            t: lp.logprob for t, lp in step.items()
        }, j
        assert scored[tok].rank == step[tok].rank
