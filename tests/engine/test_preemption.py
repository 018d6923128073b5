"""Preemption by swap and by recompute, all-or-nothing per group, chunked prefill, and a stress
test; outputs never depend on whether or how a request was preempted (cases C15, C20, C21)."""

import random

import pytest

from pagedllm.sampling_params import SamplingParams

PROMPTS = [list(range(10, 42)) + list(range(100 + 8 * i, 108 + 8 * i)) for i in range(4)]


def run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    "seeded_penalties": SamplingParams(temperature=0.8, seed=11, frequency_penalty=1.0, presence_penalty=0.5,
                                       repetition_penalty=1.2, max_tokens=40, ignore_eos=True),
    "n3": SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=40, ignore_eos=True),
    "beam": SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0, max_tokens=24, ignore_eos=True),
}


@pytest.fixture(scope="module")
def alone(request):
    factory = request.getfixturevalue("tiny_loaded")
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(loaded=factory, block_size=16, max_model_len=96, kv_cache_memory=1 << 22)
    return {k: [run(llm, [p], sp)[0] for p in PROMPTS] for k, sp in CASES.items()}


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
@pytest.mark.parametrize("case", list(CASES))
def test_outputs_identical_under_preemption(tiny_llm_factory, alone, mode, case):
    llm = tiny_llm_factory(block_size=16, num_gpu_blocks_override=12, max_model_len=96, preemption_mode=mode,
                           enable_prefix_caching=False)
    assert run(llm, PROMPTS, CASES[case]) == alone[case]
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0
    if mode == "recompute":
        assert sched.preemptions_by_mode["swap"] == 0
    if mode == "swap":
        assert sched.preemptions_by_mode["swap"] > 0 and sched.num_blocks_swapped_in > 0
    if mode == "auto" and case in ("n3", "beam"):
        assert sched.preemptions_by_mode["swap"] > 0 and sched.preemptions_by_mode["recompute"] == 0


def test_swap_falls_back_to_recompute_without_swap_space(tiny_llm_factory, alone):
    llm = tiny_llm_factory(block_size=16, num_gpu_blocks_override=12, max_model_len=96,
                           preemption_mode="swap", swap_space=0)
    assert run(llm, PROMPTS, CASES["n3"]) == alone["n3"]
    assert llm.engine.scheduler.preemptions_by_mode == {"recompute": llm.engine.scheduler.num_preemptions, "swap": 0}


@pytest.mark.parametrize("caching", [True, False])
def test_c15_chunked_prefill_equals_whole(tiny_llm_factory, caching):
    long = [list(range(5, 5 + n)) for n in (20, 40, 60)]  # 1, 2 and 3 chunks of 20 tokens
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    whole = tiny_llm_factory(block_size=4, enable_prefix_caching=caching)
    ref = run(whole, long, sp)
    chunked = tiny_llm_factory(block_size=4, enable_chunked_prefill=True, max_num_batched_tokens=20,
                               enable_prefix_caching=caching)
    assert run(chunked, long, sp) == ref
    # A prompt entirely in the cache (after a first run) still gives the same tokens.
    again = chunked.generate(long[2], sp, use_tqdm=False)[0]
    assert [again.outputs[0].token_ids] == ref[2]
    if caching:
        assert again.num_cached_tokens == 56  # all full blocks but the one holding the last token


def test_group_larger_than_pool_is_rejected(tiny_llm_factory):
    llm = tiny_llm_factory(block_size=16, num_gpu_blocks_override=4, max_model_len=96)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(PROMPTS[0], SamplingParams(n=4, max_tokens=40), use_tqdm=False)


def test_stress_200_random_requests_in_16_blocks(tiny_llm_factory):
    rng = random.Random(0)
    llm = tiny_llm_factory(block_size=8, num_gpu_blocks_override=16, max_model_len=120, max_num_seqs=16,
                           enable_chunked_prefill=True, max_num_batched_tokens=48, swap_space=1 << 20)
    eng = llm.engine
    prompts, params = [], []
    for i in range(200):
        n_prompt = rng.randint(1, 40)
        prompts.append([rng.randrange(3, 390) for _ in range(n_prompt)])
        kind = rng.random()
        if kind < 0.15:
            sp = SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=rng.randint(1, 20), ignore_eos=True)
        elif kind < 0.25:
            sp = SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0, max_tokens=rng.randint(1, 12))
        else:
            sp = SamplingParams(temperature=rng.choice([0, 0.7, 1.2]), top_p=rng.choice([1.0, 0.9]),
                                top_k=rng.choice([0, 20]), seed=i, presence_penalty=rng.choice([0, 0.5]),
                                max_tokens=rng.randint(1, 40), stop=rng.choice([None, ["ab"]]))
        prompts_sp = (prompts[-1], sp)
        params.append(prompts_sp[1])
    outs = llm.generate(prompts, params, use_tqdm=False)  # invariants checked after every step
    assert len(outs) == 200 and all(o.finished for o in outs)
    assert eng.scheduler.num_preemptions > 0
    assert max(o.metrics.num_preemptions for o in outs) <= 60
    assert eng.block_manager.num_free_blocks == 16
    assert eng.block_manager.swap_allocator.num_free == eng.block_manager.num_swap_blocks


def test_a_recomputed_n3_group_with_cached_blocks_comes_back(tiny_llm_factory):
    """An n = 3 group preempted by recompute beside a greedy request, prefix caching on: once
    the pool frees up it is readmitted and finishes (it used to wait forever with the whole
    pool free, and every request behind it with it; a helper's stress run found it)."""
    llm = tiny_llm_factory(block_size=4, num_gpu_blocks_override=10, max_model_len=128,
                           preemption_mode="recompute", enable_prefix_caching=True)
    prompts = [[247, 3, 321, 45, 236, 329, 103, 382, 97, 142],
               [247, 336, 317, 5, 249, 330, 297, 107, 117, 382, 316, 170, 187, 62, 159]]
    params = [SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
              SamplingParams(n=3, temperature=1.0, max_tokens=3, seed=22, ignore_eos=True)]
    assert _bounded_lengths(llm, list(zip(prompts, params, strict=True))) == [[13], [3, 3, 3]]
    assert llm.engine.stats.num_preemptions > 0


def _bounded_lengths(llm, requests, max_steps=300):
    """Run ``requests`` [(prompt, params)] with at most ``max_steps`` engine steps (a stall
    fails instead of hanging); returns each request's output lengths."""
    return [[len(t) for t in r] for r in _bounded_outputs(llm, requests, max_steps)]


def _bounded_outputs(llm, requests, max_steps=300):
    """``_bounded_lengths``, returning each request's output token ids."""
    engine = llm.engine
    for i, (prompt, sp) in enumerate(requests):
        engine.add_request(str(i), prompt, sp)
    done = {}
    for _ in range(max_steps):
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests(), "stalled"
    return [[list(c.token_ids) for c in done[str(i)].outputs] for i in range(len(requests))]


def _greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_a_recomputed_sample_with_prompt_logprobs_shares_the_recomputed_prompt(tiny_llm_factory):
    """n = 2 with prompt_logprobs: the fork recomputes its prompt with the lead (no cached
    copies: 8 blocks, not 14 of 12) and the group comes back (it waited forever)."""
    llm = tiny_llm_factory(block_size=4, num_gpu_blocks_override=12, max_model_len=64,
                           preemption_mode="recompute", enable_prefix_caching=True)
    sampled = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, prompt_logprobs=1,
                             ignore_eos=True)
    got = _bounded_lengths(llm, [(list(range(100, 116)), _greedy(4)), (list(range(10, 34)), sampled)])
    assert got == [[4], [6, 6]] and llm.engine.stats.num_preemptions > 0


@pytest.mark.parametrize("case", ["pool", "token-budget"])
def test_a_readmission_an_empty_engine_cannot_take_ends_by_length(tiny_llm_factory, case):
    """A group preempted by recompute whose samples outgrew the pool (3 x 17 tokens need 9 of 8
    blocks) or whose recompute exceeds max_num_batched_tokens (2 x 21 tokens in a budget of 32,
    no chunked prefill) is finished by length once nothing else runs, instead of waiting
    forever (found by a helper's fuzz)."""
    if case == "pool":
        llm = tiny_llm_factory(block_size=4, num_gpu_blocks_override=8, max_model_len=64,
                               preemption_mode="recompute", enable_prefix_caching=False)
        first, second = ([100], _greedy(8)), (list(range(10, 22)), SamplingParams(
            n=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True))
    else:
        llm = tiny_llm_factory(block_size=4, num_gpu_blocks_override=12, max_model_len=32,
                               max_num_batched_tokens=32, preemption_mode="recompute",
                               enable_prefix_caching=False)
        first, second = ([100], _greedy(16)), (list(range(10, 18)), SamplingParams(
            n=2, temperature=1.0, seed=3, max_tokens=20, ignore_eos=True))
    got = _bounded_lengths(llm, [first, second])
    assert got[0] == [first[1].max_tokens]
    assert len(got[1]) == second[1].n and all(0 < k < second[1].max_tokens for k in got[1])


def test_chunked_prefill_schedules_all_beams_or_none(tiny_llm_factory):
    """A token budget of 6 with an n = 4 request's 4 decodes first: a beam search's 3 beams
    are scheduled together or wait (2 of them made the beam step raise KeyError)."""
    llm = tiny_llm_factory(block_size=4, enable_chunked_prefill=True, max_num_batched_tokens=6,
                           max_model_len=64, num_gpu_blocks_override=64,
                           enable_prefix_caching=False)
    beams = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0, max_tokens=10,
                           ignore_eos=True)
    sampled = SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=10, ignore_eos=True)
    assert _bounded_lengths(llm, [([5, 6, 7, 8], sampled), ([9, 10, 11, 12], beams)]) == [
        [10, 10, 10, 10], [10, 10]]


def test_chunked_readmission_shares_the_recomputed_prompt(tiny_llm_factory):
    """Chunked prefill (budget 8) and recompute: an n = 2 group preempted beside an older
    request comes back with its samples sharing the recomputed prompt blocks, so both reach
    max_tokens with the tokens of a run without preemption (the other sample recomputed the
    prompt into blocks of its own, and both were finished by length at 6 and 5 of 8)."""
    sampled = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    requests = [([100], _greedy(8)), (list(range(10, 22)), sampled)]
    kw = dict(block_size=4, max_model_len=64, preemption_mode="recompute",
              enable_prefix_caching=False, enable_chunked_prefill=True, max_num_batched_tokens=8)
    small = tiny_llm_factory(num_gpu_blocks_override=8, **kw)
    got = _bounded_outputs(small, requests)
    assert [[len(t) for t in r] for r in got] == [[8], [8, 8]]
    assert small.engine.stats.num_preemptions > 0
    assert got == _bounded_outputs(tiny_llm_factory(num_gpu_blocks_override=64, **kw), requests)


@pytest.mark.parametrize("budget", [8, 12])
def test_chunked_readmission_of_a_beam_search_samples_all_beams_together(tiny_llm_factory, budget):
    """Chunked prefill and recompute: a beam search preempted beside an older request comes
    back with its beams recomputed over several steps; no beam samples before all have their
    tokens computed (one beam sampling alone made the beam step raise KeyError), and the
    beams equal a run without preemption."""
    beams = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0, max_tokens=8,
                           ignore_eos=True)
    requests = [([100], _greedy(10)), (list(range(10, 22)), beams)]
    kw = dict(block_size=4, max_model_len=64, preemption_mode="recompute",
              enable_prefix_caching=False, enable_chunked_prefill=True,
              max_num_batched_tokens=budget)
    small = tiny_llm_factory(num_gpu_blocks_override=9, **kw)
    got = _bounded_outputs(small, requests)
    assert small.engine.stats.num_preemptions > 0
    assert got == _bounded_outputs(tiny_llm_factory(num_gpu_blocks_override=64, **kw), requests)


def test_chunked_readmission_of_beams_shares_the_token_budget(tiny_llm_factory):
    """Budget 7 and a readmitted beam search whose beams have 2, 5 and 5 tokens to recompute:
    the first beams took the whole budget, the last got none, so the group was never scheduled
    again (a helper's fuzz); the budget is now shared among the beams, and the outputs equal a
    run without preemption."""
    beams = [SamplingParams(n=1, best_of=b, use_beam_search=True, temperature=0, max_tokens=m,
                            ignore_eos=True) for b, m in ((2, 7), (3, 6))]
    requests = [([39, 11, 28, 42, 8, 37, 18, 7], beams[0]), ([9, 20, 10, 40, 32], beams[1]),
                ([57, 41, 12, 19], _greedy(20))]
    kw = dict(block_size=4, max_model_len=64, preemption_mode="recompute",
              enable_prefix_caching=False, enable_chunked_prefill=True, max_num_batched_tokens=7)
    small = tiny_llm_factory(num_gpu_blocks_override=9, **kw)
    got = _bounded_outputs(small, requests)
    assert small.engine.stats.num_preemptions > 0
    assert got == _bounded_outputs(tiny_llm_factory(num_gpu_blocks_override=64, **kw), requests)


def test_prompt_logprobs_recomputed_mid_prefill_are_not_appended_twice(tiny_llm_factory):
    """A prompt_logprobs request preempted by recompute between two prefill chunks: the
    recomputed chunk's rows for positions already kept were appended after them (positions
    17-23 repeated what 1-7 predicted); they equal a run without preemption."""
    prompt = [41, 19, 5, 53, 38, 56, 35, 55, 56, 22, 19, 58, 29, 37, 52, 50, 45, 52, 15, 20, 22,
              44, 7, 51]
    params = [SamplingParams(n=3, temperature=1.0, seed=1000, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=1)]
    prompts = [[1, 2, 3, 4, 5, 6, 7], prompt]
    kw = dict(block_size=4, max_model_len=64, enable_chunked_prefill=True)
    small = tiny_llm_factory(num_gpu_blocks_override=8, preemption_mode="recompute",
                             max_num_batched_tokens=13, **kw)
    roomy = tiny_llm_factory(num_gpu_blocks_override=256, **kw)
    got, want = (llm.generate(prompts, params, use_tqdm=False)[1] for llm in (small, roomy))
    assert small.engine.scheduler.num_preemptions > 0
    assert len(got.prompt_logprobs) == len(prompt) and got.prompt_logprobs[0] is None
    for g, w in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
        assert g.keys() == w.keys()
        assert all(abs(g[t].logprob - w[t].logprob) < 1e-4 for t in g)
