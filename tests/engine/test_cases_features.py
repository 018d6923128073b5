"""The engine-side cases of /work/shared/cases (C15, C19, C20, C21) replayed under each opt-in
engine feature on the tiny model: speculative decoding, int8 weights (W8A8), an int8 KV cache,
bf16 weights and KV cache with speculative decoding.
Outputs under a feature never depend on the batch, on chunked prefill or on preemption: each
request equals itself run alone *with the same feature* (the lossy formats change the tokens, not
this property), and every KV block is free at idle."""

from __future__ import annotations

from typing import Any

import pytest

from pagedllm.sampling_params import SamplingParams

FEATURES: dict[str, dict[str, Any]] = {
    "ngram_spec": {
        "speculative_config": {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 2,
        }
    },
    "int8_weights": {"quantization": "int8"},
    "int8_kv": {"kv_cache_dtype": "int8"},
    # bf16 weights and KV cache on the head_dim-64 model: on AVX512-BF16 CPUs the bf16
    # dot-product attention, on AMX CPUs on AMX tiles (csrc/cpu/attention_amx.h),
    # and speculation on top of it.
    "bf16_ngram_spec": {
        "loaded": "hd64",
        "dtype": "bfloat16",
        "speculative_config": {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 2,
        },
    },
}
# A 32-token shared prefix (two blocks of 16) and an 8-token suffix per request; repeated n-grams
# give the n-gram proposer something to propose.
PREFIX = [10, 11, 12, 13] * 8
PROMPTS = [PREFIX + list(range(100 + 8 * i, 108 + 8 * i)) for i in range(4)]
SEEDED = SamplingParams(
    temperature=0.8, seed=11, frequency_penalty=1.0, repetition_penalty=1.2, max_tokens=40,
    ignore_eos=True,
)  # fmt: skip
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def feature_args(feature: str, hd64: Any) -> dict[str, Any]:
    """The LLM arguments of ``feature``, its ``"hd64"`` model marker replaced by ``hd64``."""
    args = dict(FEATURES[feature])
    if args.get("loaded") == "hd64":
        args["loaded"] = hd64
    return args


def token_ids(llm: Any, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_idle_and_free(llm: Any) -> None:
    bm = llm.engine.block_manager
    assert not llm.engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    assert set(bm.allocator.ref_counts) == {0}


@pytest.mark.slow  # > 20 s on 2 shared cores
@pytest.mark.parametrize("feature", list(FEATURES))
def test_c20_c21_preemption_under_feature(tiny_llm_factory, tiny_loaded_hd64, feature):
    """C20 (greedy, shared prefixes, caching on) and C21 (seeded sampling with penalties): a pool
    of 8 blocks of 16 with 4 requests preempts; each output equals the request alone."""
    args = {
        "block_size": 16, "max_model_len": 96, "kv_cache_memory": 1 << 22,
        **feature_args(feature, tiny_loaded_hd64),
    }  # fmt: skip
    big = tiny_llm_factory(**args)
    small = tiny_llm_factory(
        num_gpu_blocks_override=8, max_num_seqs=4, enable_prefix_caching=True, **args
    )
    for params in (GREEDY, SEEDED):
        alone = [token_ids(big, [p], params)[0] for p in PROMPTS]
        assert token_ids(small, PROMPTS, params) == alone, params
    assert small.engine.scheduler.num_preemptions > 0
    assert_idle_and_free(small)
    assert_idle_and_free(big)


@pytest.mark.slow  # > 20 s on 2 shared cores
@pytest.mark.parametrize("feature", list(FEATURES))
def test_c15_greedy_independent_of_batch_under_feature(
    tiny_llm_factory, tiny_loaded_hd64, feature
):
    """C15: a prompt alone, among 7 others, and under a token budget that forces chunked prefill
    gives identical greedy token ids (float32, CPU)."""
    args = {
        "block_size": 4, "max_model_len": 96, "kv_cache_memory": 1 << 22,
        **feature_args(feature, tiny_loaded_hd64),
    }  # fmt: skip
    prompts = [[5 + i + j for j in range(10 + 2 * i)] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = tiny_llm_factory(**args)
    alone = token_ids(plain, prompts[:1], params)[0]
    assert token_ids(plain, prompts, params)[0] == alone
    chunked = tiny_llm_factory(enable_chunked_prefill=True, max_num_batched_tokens=8, **args)
    assert token_ids(chunked, prompts, params)[0] == alone
    assert_idle_and_free(chunked)


def test_c15_bf16_prompts_at_prefill_sizes(tiny_llm_factory, tiny_loaded_hd64):
    """C15 across the bf16 GEMM's two thread splits: 8 prompts of 80 tokens prefilled in one
    step (640 rows: on AMX CPUs the threads split the rows, csrc/cpu/gemm_amx.cpp) and the
    first prompt alone (80 rows: the threads split the weight panels) give the same greedy
    tokens."""
    args = {
        "loaded": tiny_loaded_hd64, "dtype": "bfloat16", "block_size": 16,
        "max_model_len": 96, "kv_cache_memory": 1 << 23,
    }  # fmt: skip
    prompts = [[5 + (7 * i + j) % 40 for j in range(80)] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = tiny_llm_factory(**args)
    alone = token_ids(llm, prompts[:1], params)[0]
    together = token_ids(llm, prompts, params)
    assert together[0] == alone
    assert_idle_and_free(llm)


@pytest.mark.parametrize("feature", list(FEATURES))
def test_c19_no_prefix_cache_collision_under_feature(
    tiny_llm_factory, tiny_loaded_hd64, feature
):
    """C19: [65]*32 then [321]*32, block size 16: the second reports 0 cached tokens and equals
    its caching-off output; repeating the first hits the cache (16 tokens) with the same output."""
    args = {
        "block_size": 16, "max_model_len": 96, "kv_cache_memory": 1 << 22,
        **feature_args(feature, tiny_loaded_hd64),
    }  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cached = tiny_llm_factory(enable_prefix_caching=True, **args)
    uncached = tiny_llm_factory(enable_prefix_caching=False, **args)
    first, second = [65] * 32, [321] * 32
    out1 = cached.generate(first, params, use_tqdm=False)[0]
    out2 = cached.generate(second, params, use_tqdm=False)[0]
    assert out2.num_cached_tokens == 0
    assert out2.outputs[0].token_ids == token_ids(uncached, [second], params)[0]
    again = cached.generate(first, params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 16
    assert again.outputs[0].token_ids == out1.outputs[0].token_ids
    assert_idle_and_free(cached)
