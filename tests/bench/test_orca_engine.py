"""The engine with each KV manager on the tiny model: same greedy tokens as the paged engine, no
leaked blocks, reservations all-or-nothing, and the memory-waste / batch statistics."""

import pytest

from pagedllm.core.contiguous_kv_manager import ContiguousKVManager
from pagedllm.sampling_params import SamplingParams

PROMPTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog and then",
    "a block table maps",
    "paged attention stores keys and values in blocks; continuous batching lets new requests join",
    "x",
    "continuous batching",
]
LENS = [24, 5, 17, 9, 30, 12]


def run(llm):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in LENS]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def paged_tokens(tiny_loaded):
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(loaded=tiny_loaded, max_model_len=128, kv_cache_memory=1 << 22)
    return run(llm)


@pytest.mark.parametrize("kv_manager", ["orca-max", "orca-pow2", "orca-oracle"])
def test_orca_engine_matches_paged_and_frees_everything(tiny_llm_factory, paged_tokens, kv_manager):
    # 64 blocks of 4 tokens; orca-max reserves 128 tokens = 32 blocks: two requests at a time.
    llm = tiny_llm_factory(
        kv_manager=kv_manager, block_size=4, num_gpu_blocks_override=64, max_model_len=128
    )
    bm = llm.engine.block_manager
    assert isinstance(bm, ContiguousKVManager)
    assert run(llm) == paged_tokens
    st = llm.engine.stats
    assert st.num_preemptions == 0  # reserved up front: never preempted for growth
    assert bm.num_free_blocks == bm.num_blocks
    if kv_manager == "orca-max":
        assert st.peak_blocks_used == 64 and st.mean_batched_requests <= 2
    waste = st.memory_waste()
    assert sum(waste.values()) == pytest.approx(1.0)
    if kv_manager == "orca-max":
        assert waste["internal_fragmentation"] > 0.5


def test_paged_batches_more_and_wastes_less(tiny_llm_factory):
    kw = dict(block_size=4, num_gpu_blocks_override=64, max_model_len=128)
    paged = tiny_llm_factory(enable_prefix_caching=False, **kw)
    orca = tiny_llm_factory(kv_manager="orca-max", **kw)
    run(paged)
    run(orca)
    ps, os_ = paged.engine.stats, orca.engine.stats
    assert ps.mean_batched_requests > os_.mean_batched_requests
    pw, ow = ps.memory_waste(), os_.memory_waste()
    assert pw["token_states"] > 0.8 > ow["token_states"]
    assert pw["external_fragmentation"] == 0.0


def test_orca_refuses_parallel_sampling_and_oversized_requests(tiny_llm_factory):
    llm = tiny_llm_factory(
        kv_manager="orca-oracle", block_size=4, num_gpu_blocks_override=24, max_model_len=128
    )
    with pytest.raises(ValueError, match="^n:"):
        llm.generate(["hello"], SamplingParams(n=2, max_tokens=4), use_tqdm=False)
    # 90 tokens -> 23 blocks -> chunk of 32 > the pool's largest root (16 blocks).
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(["hello"], SamplingParams(max_tokens=88, ignore_eos=True), use_tqdm=False)


def test_bad_kv_manager_is_a_value_error():
    from pagedllm.config import EngineConfig

    with pytest.raises(ValueError, match="kv_manager"):
        EngineConfig(kv_manager="contiguous")
