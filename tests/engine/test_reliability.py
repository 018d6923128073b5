"""Issue 24's engine items on the tiny random Llama: prompt logprobs after a prefix-cache hit,
streamed text that never stays held back, requests that can never be scheduled (refused up front
naming ``n`` / ``best_of``, or finished by length) and no hang after a swap-out.

Every test ends with an idle engine whose pool is consistent and entirely free.
"""

from __future__ import annotations

import pytest

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams


def make_engine(tiny_loaded, **kw) -> LLMEngine:
    kw.setdefault("max_model_len", 128)
    kw.setdefault("kv_cache_memory", 1 << 21)
    return LLMEngine(EngineConfig(check_invariants=True, num_threads=1, **kw), loaded=tiny_loaded)


def run_all(eng: LLMEngine, max_steps: int = 2000) -> dict:
    """Step until idle (at most ``max_steps``); returns the final output of every request."""
    final = {}
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    assert not eng.has_unfinished_requests(), "the engine did not finish within the step cap"
    return final


def assert_pool_free(eng: LLMEngine) -> None:
    bm = eng.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.ref_counts() == [0] * bm.num_blocks


# ---- item 1: prompt logprobs on a prompt whose first blocks are cached ---------------------------
def test_prompt_logprobs_after_a_prefix_cache_hit(tiny_loaded):
    eng = make_engine(tiny_loaded, block_size=16)
    prompt = [(7 * i + 3) % 300 + 2 for i in range(33)]  # 33 tokens: 2 full blocks of 16
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1, ignore_eos=True)
    eng.add_request("first", prompt, params)
    first = run_all(eng)["first"]
    eng.add_request("second", prompt, params)
    second = run_all(eng)["second"]
    # The second request took no cache hit and computed every prompt position again.
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 0)
    assert first.prompt_logprobs is not None and second.prompt_logprobs is not None
    assert len(second.prompt_logprobs) == 33 and second.prompt_logprobs[0] is None
    for a, b in zip(first.prompt_logprobs[1:], second.prompt_logprobs[1:], strict=True):
        assert a is not None and b is not None
        assert list(a) == list(b)
        for tid in a:
            assert b[tid].logprob == pytest.approx(a[tid].logprob, abs=1e-5)
            assert b[tid].rank == a[tid].rank
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    # The blocks it computed are still cached for the others: 32 tokens hit without logprobs.
    eng.add_request("third", prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    third = run_all(eng)["third"]
    assert third.num_cached_tokens == 32
    assert third.outputs[0].token_ids == first.outputs[0].token_ids
    assert_pool_free(eng)
