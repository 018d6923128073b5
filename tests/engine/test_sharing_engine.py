"""Parallel sampling, copy-on-write and prefix caching through the whole engine (tiny model)."""

import pytest

from pagedllm.sampling.sampler import derive_seed
from pagedllm.sampling_params import SamplingParams

PROMPT = "paged attention stores keys and values in blocks"


def tokens(llm, prompt, params):
    return [c.token_ids for c in llm.generate(prompt, params, use_tqdm=False)[0].outputs]


def test_c12_n_samples_with_a_seed(tiny_llm_factory):
    llm = tiny_llm_factory(block_size=4)
    sp = SamplingParams(n=4, seed=1234, temperature=1.0, max_tokens=24, ignore_eos=True)
    out = llm.generate(PROMPT, sp, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    texts = [c.text for c in out.outputs]
    assert len(set(texts)) > 1
    assert [c.text for c in llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs] == texts
    # Sample i equals a single-sample request seeded with derive_seed(1234, i).
    for i, c in enumerate(out.outputs):
        single = SamplingParams(
            seed=derive_seed(1234, i), temperature=1.0, max_tokens=24, ignore_eos=True
        )
        assert tokens(llm, PROMPT, single) == [c.token_ids]
    # Without a seed two requests differ.
    unseeded = SamplingParams(n=4, temperature=1.0, max_tokens=24, ignore_eos=True)
    assert tokens(llm, PROMPT, unseeded) != tokens(llm, PROMPT, unseeded)


def test_parallel_samples_share_prompt_blocks(tiny_llm_factory):
    llm = tiny_llm_factory(block_size=4, enable_prefix_caching=False)
    eng = llm.engine
    eng.add_request(
        "r", PROMPT, SamplingParams(n=3, seed=1, temperature=1.0, max_tokens=8, ignore_eos=True)
    )
    eng.step()  # prefill + first sample: the sequence forks into 3
    group = eng.requests["r"]
    assert len(group.seqs) == 3
    n_prompt = len(group.seqs[0].prompt_token_ids)
    full = n_prompt // 4
    tables = [list(eng.block_manager.get_block_table(s)) for s in group.seqs]
    assert tables[0] == tables[1] == tables[2]
    assert all(eng.block_manager.allocator.ref_counts[b] == 3 for b in tables[0])
    sched = eng.scheduler.schedule()  # next step: copy-on-write of the shared last block
    copies = sched.blocks_to_copy
    if n_prompt % 4:
        assert len(copies) == 2 and {src for src, _ in copies} == {tables[0][-1]}
    else:
        assert copies == []
    new_tables = [w.block_table for _, w in sched.scheduled]
    assert all(t[:full] == tables[0][:full] for t in new_tables)  # full blocks stay shared
    eng.executor.execute_model(sched)
    eng.scheduler.on_step_done(sched)
    eng.abort_request("r")


def test_best_of_returns_the_n_most_likely(tiny_llm_factory):
    llm = tiny_llm_factory()
    out = llm.generate(
        PROMPT,
        SamplingParams(n=2, best_of=5, seed=3, temperature=1.0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )[0]
    all5 = llm.generate(
        PROMPT,
        SamplingParams(n=5, seed=3, temperature=1.0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )[0]
    best = sorted(all5.outputs, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in best]
    assert [c.index for c in out.outputs] == [0, 1]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_prefix_caching_on_equals_off(tiny_llm_factory, temperature):
    shared = "continuous batching lets new requests join between steps. " * 3
    prompts = [
        shared + s for s in ("hello world", "the quick brown fox", "a block table maps", "x y z")
    ]
    sp = SamplingParams(temperature=temperature, seed=7, max_tokens=16, ignore_eos=True)
    on = tiny_llm_factory(block_size=4)
    off = tiny_llm_factory(block_size=4, enable_prefix_caching=False)
    first = on.generate(prompts[:1], sp, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    outs_on = on.generate(prompts, sp, use_tqdm=False)
    outs_off = off.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs_on] == [o.outputs[0].token_ids for o in outs_off]
    assert all(o.num_cached_tokens >= 4 for o in outs_on)
    assert all(o.num_cached_tokens == 0 for o in outs_off)
    assert on.engine.block_manager.prefix_cache.hit_rate > 0


def test_reset_prefix_cache_makes_a_repeat_cold(tiny_llm_factory):
    llm = tiny_llm_factory(block_size=4)
    prompt = "a block table maps logical blocks to physical ones. " * 2
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = llm.generate([prompt], sp, use_tqdm=False)[0]
    warm = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and warm.num_cached_tokens > 0
    assert llm.reset_prefix_cache() > 0
    cold = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0
    assert cold.outputs[0].token_ids == first.outputs[0].token_ids


def test_c19_no_prefix_cache_collisions(tiny_llm_factory):
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a, b = [65] * 32, [321] * 32
    on = tiny_llm_factory(block_size=16)
    off = tiny_llm_factory(block_size=16, enable_prefix_caching=False)
    ref_a = off.generate(a, sp, use_tqdm=False)[0].outputs[0].token_ids
    ref_b = off.generate(b, sp, use_tqdm=False)[0].outputs[0].token_ids
    assert on.generate(a, sp, use_tqdm=False)[0].outputs[0].token_ids == ref_a
    out_b = on.generate(b, sp, use_tqdm=False)[0]
    assert out_b.outputs[0].token_ids == ref_b and out_b.num_cached_tokens == 0
    again = on.generate(a, sp, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == ref_a and again.num_cached_tokens == 16


def test_c20_memory_pressure_with_shared_prefixes(tiny_llm_factory, tiny_tokenizer):
    prefix = list(range(10, 42))  # 32-token shared prefix
    prompts = [prefix + list(range(100 + 8 * i, 108 + 8 * i)) for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    big = tiny_llm_factory(block_size=16)
    alone = [big.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    small = tiny_llm_factory(
        block_size=16, num_gpu_blocks_override=8, max_num_seqs=4, max_model_len=96
    )
    outs = small.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert small.engine.stats.num_preemptions > 0
    assert max(o.metrics.num_preemptions for o in outs) <= 8


def test_c21_preemption_keeps_sampling_state_with_n(tiny_llm_factory):
    sp = SamplingParams(
        n=2,
        temperature=0.8,
        seed=11,
        frequency_penalty=1.0,
        repetition_penalty=1.2,
        max_tokens=48,
        ignore_eos=True,
    )
    prompts = [list(range(10, 42)) + list(range(100 + 8 * i, 108 + 8 * i)) for i in range(4)]
    big = tiny_llm_factory(block_size=16)
    alone = [[c.token_ids for c in big.generate(p, sp, use_tqdm=False)[0].outputs] for p in prompts]
    small = tiny_llm_factory(
        block_size=16, num_gpu_blocks_override=12, max_num_seqs=8, max_model_len=96
    )
    outs = small.generate(prompts, sp, use_tqdm=False)
    assert small.engine.stats.num_preemptions > 0
    assert [[c.token_ids for c in o.outputs] for o in outs] == alone


def test_sharing_saving_is_reported(tiny_llm_factory):
    llm = tiny_llm_factory(block_size=4)
    llm.generate(
        PROMPT,
        SamplingParams(n=4, seed=1, temperature=1.0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    assert 0 < llm.engine.stats.sharing_saving < 1
