"""The LLMEngine facade over input processor -> engine core -> output processor: the paper-figure
accounting is off unless enabled (cheap counters always on), the stages share the EOS ids, and
the KV manager's admission errors reach ``validate_request`` unchanged."""

import pytest

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import ContextLengthExceededError, LLMEngine
from pagedllm.sampling_params import SamplingParams


def make_engine(tiny_loaded, **kw):
    kw.setdefault("max_model_len", 128)
    kw.setdefault("kv_cache_memory", 1 << 21)
    return LLMEngine(EngineConfig(check_invariants=True, num_threads=1, **kw), loaded=tiny_loaded)


def drain(eng):
    while eng.has_unfinished_requests():
        eng.step()


def test_kv_stats_off_by_default_then_observed(tiny_loaded):
    eng = make_engine(tiny_loaded, enable_prefix_caching=False)
    assert not eng.kv_stats_enabled
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eng.add_request("a", [5, 6, 7, 8, 9], params)
    eng.add_request("b", [3, 4, 5], SamplingParams(n=2, temperature=0.8, max_tokens=6, seed=1,
                                                    ignore_eos=True))
    drain(eng)
    st = eng.stats
    assert st.num_steps > 0 and st.prompt_tokens == 8 and st.generation_tokens == 18
    assert st.peak_blocks_used > 0
    assert (st.observed_steps, st.blocks_used_sum, st.batched_requests_sum, st.kv_waste_steps) == (
        0, 0, 0, 0)
    assert st.mean_batched_requests == 0.0 and st.mean_slot_utilization == 0.0

    eng.enable_kv_stats()
    assert eng.kv_stats_enabled
    steps0 = st.num_steps
    eng.add_request("c", [5, 6, 7, 8, 9], SamplingParams(n=3, temperature=0.8, max_tokens=5,
                                                        seed=2, ignore_eos=True))
    drain(eng)
    assert st.observed_steps == st.num_steps - steps0 > 0
    assert st.mean_batched_requests == 1.0
    assert 0 < st.mean_slot_utilization <= 1
    assert 0 < st.sharing_saving < 1  # three samples share the prompt's blocks
    assert sum(st.memory_waste().values()) == pytest.approx(1.0)

    eng.enable_kv_stats(False)
    observed = st.observed_steps
    eng.add_request("d", [1, 2], params)
    drain(eng)
    assert st.observed_steps == observed
    assert eng.block_manager.num_free_blocks == eng.num_blocks


def test_eos_ids_reach_every_stage(tiny_loaded):
    eng = make_engine(tiny_loaded)
    ref = make_engine(tiny_loaded)
    ref.add_request("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    out = []
    while ref.has_unfinished_requests():
        out = ref.step() or out
    tokens = out[0].outputs[0].token_ids
    k = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    eng.eos_token_ids = [tokens[k]]
    assert eng.input_processor.eos_token_ids == eng.output_processor.eos_token_ids == [tokens[k]]
    eng.add_request("x", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8))
    while eng.has_unfinished_requests():
        out = eng.step() or out
    c = out[0].outputs[0]
    assert c.token_ids == tokens[: k + 1] and c.finish_reason == "stop"


def test_orca_admission_errors_through_the_engine(tiny_loaded):
    eng = make_engine(
        tiny_loaded, kv_manager="orca-oracle", block_size=4, num_gpu_blocks_override=24
    )
    with pytest.raises(ValueError) as e:
        eng.validate_request([1, 2], SamplingParams(n=2, max_tokens=4))
    assert str(e.value) == (
        "n: kv_manager='orca-oracle' reserves one contiguous run per request and cannot "
        "share it; parallel sampling and beam search need 'paged'"
    )
    with pytest.raises(ContextLengthExceededError) as e2:
        eng.validate_request([1, 2], SamplingParams(max_tokens=88))
    assert e2.value.param == "max_tokens"
    assert str(e2.value) == (
        "max_tokens: the orca-oracle reservation of 90 tokens needs a chunk of 32 blocks, more "
        "than the pool's largest (16 blocks of 4 tokens)"
    )
    assert eng.validate_request([1, 2], SamplingParams(max_tokens=62)) == 62
    with pytest.raises(ContextLengthExceededError, match="prompt is 128 tokens"):
        eng.validate_request([1] * 128, SamplingParams())


def test_paged_pool_limit_through_the_engine(tiny_loaded):
    eng = make_engine(tiny_loaded, block_size=4, num_gpu_blocks_override=8)
    with pytest.raises(ContextLengthExceededError) as e:
        eng.validate_request([1] * 10, SamplingParams(max_tokens=30))
    assert str(e.value) == (
        "max_tokens: a sample of up to 40 tokens needs more KV blocks than the whole pool "
        "(8 blocks of 4 tokens)"
    )
