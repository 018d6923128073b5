"""Behaviour of the batched sampler on small hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.sampling.prompt_logprobs import compute_prompt_logprobs
from pagedllm.sampling.sampler import (
    Sampler,
    SamplingBatch,
    counter_uniform,
    counter_uniform_py,
    derive_seed,
)
from pagedllm.sampling_params import SamplingParams

NEG_INF = float("-inf")


def make_batch(params, outputs=None, prompts=None, seeds=None, eos=(0,)):
    b = len(params)
    return SamplingBatch(
        params=list(params),
        seeds=list(seeds) if seeds is not None else [1234 + i for i in range(b)],
        output_token_ids=[list(o) for o in outputs]
        if outputs is not None
        else [[] for _ in params],
        prompt_token_ids=[list(p) for p in prompts]
        if prompts is not None
        else [[] for _ in params],
        eos_token_ids=list(eos),
    )


def sample_one(logits_row, params, output=(), prompt=(), seed=0, eos=(0,)):
    logits = torch.tensor([logits_row], dtype=torch.float32)
    sampler = Sampler(logits.shape[1])
    batch = make_batch([params], [output], [prompt], [seed], eos)
    return sampler(logits, batch)


GREEDY = SamplingParams(temperature=0.0)


def test_greedy_is_argmax_and_logits_untouched():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    before = logits.clone()
    out = Sampler(50)(logits, make_batch([GREEDY] * 6))
    assert out.sampled_token_ids == logits.argmax(-1).tolist()
    assert torch.equal(logits, before)
    assert out.top_logprobs == [None] * 6
    assert out.sampled_ranks == [0] * 6  # not computed: no row asked for logprobs
    with_lp = Sampler(50)(logits, make_batch([SamplingParams(temperature=0.0, logprobs=0)] * 6))
    assert with_lp.sampled_ranks == [1] * 6


def test_bf16_and_padded_vocab():
    torch.manual_seed(1)
    logits = torch.randn(3, 40)
    logits[:, 32:] = 100.0  # padding columns beyond the real vocabulary are ignored
    out = Sampler(32)(logits.bfloat16(), make_batch([GREEDY] * 3))
    assert out.sampled_token_ids == logits.bfloat16().float()[:, :32].argmax(-1).tolist()


def test_repetition_penalty_prompt_only_token():
    # token 1 (logit 3.0) seen only in the prompt: halved to 1.5 < token 2 (2.0)
    row = [0.0, 3.0, 2.0, -1.0]
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert sample_one(row, p, prompt=[1]).sampled_token_ids == [2]
    assert sample_one(row, GREEDY, prompt=[1]).sampled_token_ids == [1]
    # 3.0 / 1.4 = 2.14 > 2.0: still token 1
    p14 = SamplingParams(temperature=0.0, repetition_penalty=1.4)
    assert sample_one(row, p14, prompt=[1]).sampled_token_ids == [1]
    # negative logits are multiplied: token 0 at -0.5 -> -1.0 falls below token 3 at -0.9
    row_neg = [-0.5, -3.0, -3.0, -0.9]
    p2 = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert sample_one(row_neg, p2, output=[0]).sampled_token_ids == [3]
    assert sample_one(row_neg, GREEDY, output=[0]).sampled_token_ids == [0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repetition_penalty_past_the_float_range_keeps_its_limit(dtype):
    """repetition_penalty 1e-40 (a float32 denormal) made a seen token's positive logit inf and
    every sampled token 0; 1e39 (inf in float32) made a zero logit nan. The limits instead: a
    tiny penalty makes the seen token with a positive logit certain, a huge one leaves the seen
    tokens' positive logits at ~0 and their negative ones at the bottom."""
    row = torch.tensor([[0.0, 3.0, 2.0, -1.0, 1.0]], dtype=dtype)
    for seed in range(20):
        for temperature in (1.0, 0.5, 0.0):
            tiny = SamplingParams(temperature=temperature, repetition_penalty=1e-40, logprobs=1)
            out = Sampler(5)(row.clone(), make_batch([tiny], prompts=[[4]], seeds=[seed]))
            assert out.sampled_token_ids == [4]
            assert math.isfinite(out.sampled_logprobs[0])
    huge = SamplingParams(temperature=0.0, repetition_penalty=1e39)
    assert Sampler(5)(row.clone(), make_batch([huge], prompts=[[1, 2, 0]])).sampled_token_ids == [4]
    for seed in range(20):
        out = Sampler(5)(row.clone(), make_batch([SamplingParams(repetition_penalty=1e39)],
                                                 prompts=[[1, 2, 0]], seeds=[seed]))
        assert out.sampled_token_ids[0] in (0, 1, 2, 3, 4)
        assert math.isfinite(out.sampled_logprobs[0])


def test_frequency_and_presence_exact_values():
    # token 1 occurs twice in the output, token 2 once in the prompt only
    row = [0.0, 3.0, 2.2, 1.3]
    # frequency 0.5: token 1 -> 3.0 - 2*0.5 = 2.0 < 2.2 (prompt token 2 untouched)
    p = SamplingParams(temperature=0.0, frequency_penalty=0.5)
    assert sample_one(row, p, output=[1, 1], prompt=[2, 2, 2]).sampled_token_ids == [2]
    # frequency 0.35: 3.0 - 0.7 = 2.3 > 2.2
    p = SamplingParams(temperature=0.0, frequency_penalty=0.35)
    assert sample_one(row, p, output=[1, 1], prompt=[2]).sampled_token_ids == [1]
    # presence 0.75 once: 3.0 - 0.75 = 2.25 > 2.2; presence 0.85 -> 2.15 < 2.2
    p = SamplingParams(temperature=0.0, presence_penalty=0.75)
    assert sample_one(row, p, output=[1, 1], prompt=[2]).sampled_token_ids == [1]
    p = SamplingParams(temperature=0.0, presence_penalty=0.85)
    assert sample_one(row, p, output=[1, 1], prompt=[2]).sampled_token_ids == [2]
    # prompt-only occurrences are ignored by presence / frequency
    p = SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0)
    assert sample_one(row, p, prompt=[1, 1, 1]).sampled_token_ids == [1]


def test_penalties_exact_effect_via_seeded_equivalence():
    # Penalised logits [0, 1.5, 2, -1] (rep 2 on prompt token 1) must sample exactly like the
    # hand-computed logits without penalty, with the same seed and step.
    row = [0.0, 3.0, 2.0, -1.0]
    expected = [0.0, 1.5, 2.0, -1.0]
    for seed in range(30):
        a = sample_one(row, SamplingParams(repetition_penalty=2.0), prompt=[1], seed=seed)
        b = sample_one(expected, SamplingParams(), seed=seed)
        assert a.sampled_token_ids == b.sampled_token_ids
        # logprobs are reported from the RAW distribution
        assert a.sampled_logprobs[0] == pytest.approx(
            torch.log_softmax(torch.tensor(row), -1)[a.sampled_token_ids[0]].item(), abs=1e-5
        )
    # frequency 0.5 x2 and presence 0.25 on output token 2: 2.0 - 1.0 - 0.25 = 0.75
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    for seed in range(30):
        a = sample_one(row, p, output=[2, 2], prompt=[1, 3], seed=seed)
        b = sample_one([0.0, 3.0, 0.75, -1.0], SamplingParams(), output=[2, 2], seed=seed)
        assert a.sampled_token_ids == b.sampled_token_ids


def test_logit_bias():
    row = [0.0, 3.0, 2.0, -1.0]
    p = SamplingParams(temperature=0.0, logit_bias={3: 4.5})
    assert sample_one(row, p).sampled_token_ids == [3]
    p = SamplingParams(temperature=0.0, logit_bias={"1": -100})
    assert sample_one(row, p).sampled_token_ids == [2]
    out = sample_one(row, SamplingParams(temperature=0.0, logit_bias={3: 4.5}, logprobs=0))
    # reported logprob is raw: token 3 is the least likely under the raw distribution
    assert out.sampled_ranks == [4]
    assert out.sampled_logprobs[0] == pytest.approx(
        torch.log_softmax(torch.tensor(row), -1)[3].item(), abs=1e-5
    )


def test_min_tokens_masks_eos_and_stop_ids():
    row = [5.0, 4.0, 3.0, 1.0]  # eos=0 best, stop id 1 second
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1])
    assert sample_one(row, p, output=[], eos=[0]).sampled_token_ids == [2]
    assert sample_one(row, p, output=[3], eos=[0]).sampled_token_ids == [2]
    assert sample_one(row, p, output=[3, 3], eos=[0]).sampled_token_ids == [0]
    # ignore_eos: EOS is not masked (it is never a stop), stop ids still are
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1], ignore_eos=True)
    assert sample_one(row, p, output=[], eos=[0]).sampled_token_ids == [0]
    row2 = [1.0, 4.0, 3.0, 5.0]
    p = SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[3])
    assert sample_one(row2, p, eos=[1]).sampled_token_ids == [2]
    # random sampling never picks a masked id
    p = SamplingParams(temperature=1.0, min_tokens=5, stop_token_ids=[1])
    for seed in range(50):
        assert sample_one(row, p, seed=seed, eos=[0]).sampled_token_ids[0] in (2, 3)


def test_top_k_one_equals_greedy_and_small_top_p():
    torch.manual_seed(2)
    logits = torch.randn(8, 64) * 3
    greedy = logits.argmax(-1).tolist()
    s = Sampler(64)
    for params in (
        SamplingParams(temperature=1.5, top_k=1),
        SamplingParams(temperature=1.5, top_p=1e-6),
        SamplingParams(temperature=2.0, min_p=1.0),
    ):
        out = s(logits, make_batch([params] * 8, seeds=range(8)))
        assert out.sampled_token_ids == greedy


def test_top_k_restricts_support():
    row = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5]
    p = SamplingParams(temperature=5.0, top_k=2)
    seen = {sample_one(row, p, seed=s).sampled_token_ids[0] for s in range(200)}
    assert seen == {0, 1}


def test_top_p_restricts_support():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    row = probs.log().tolist()
    p = SamplingParams(top_p=0.75)  # needs 0.5 + 0.3 -> {0, 1}
    seen = {sample_one(row, p, seed=s).sampled_token_ids[0] for s in range(300)}
    assert seen == {0, 1}
    p = SamplingParams(top_p=0.85)  # 0.8 < 0.85 -> also token 2
    seen = {sample_one(row, p, seed=s).sampled_token_ids[0] for s in range(300)}
    assert seen == {0, 1, 2}


def test_min_p_restricts_support():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    row = probs.log().tolist()
    p = SamplingParams(min_p=0.6)  # threshold 0.24 -> {0, 1}
    seen = {sample_one(row, p, seed=s).sampled_token_ids[0] for s in range(300)}
    assert seen == {0, 1}
    p = SamplingParams(min_p=0.3)  # threshold 0.12 -> {0, 1, 2}
    seen = {sample_one(row, p, seed=s).sampled_token_ids[0] for s in range(300)}
    assert seen == {0, 1, 2}


def test_seeded_row_is_batch_independent():
    torch.manual_seed(3)
    V = 1000
    target = torch.randn(V)
    p = SamplingParams(temperature=1.0, top_p=0.95, top_k=200)
    out_alone = Sampler(V)(target[None], make_batch([p], [[7, 8, 9]], [[1, 2]], [424242]))
    for pos in range(6):
        others = torch.randn(6, V)
        logits = others.clone()
        logits[pos] = target
        params = [SamplingParams(temperature=0.8, top_k=50, seed=i) for i in range(6)]
        params[pos] = p
        seeds = [99 + i for i in range(6)]
        seeds[pos] = 424242
        outputs = [[1] * i for i in range(6)]
        outputs[pos] = [7, 8, 9]
        prompts = [[3, 4]] * 6
        prompts[pos] = [1, 2]
        out = Sampler(V)(logits, make_batch(params, outputs, prompts, seeds))
        assert out.sampled_token_ids[pos] == out_alone.sampled_token_ids[0]
        assert out.sampled_logprobs[pos] == pytest.approx(out_alone.sampled_logprobs[0], abs=1e-6)


def test_different_steps_and_seeds_give_different_draws():
    V = 500
    row = torch.zeros(V).tolist()  # uniform distribution
    p = SamplingParams()
    by_step = {sample_one(row, p, output=[5] * t, seed=7).sampled_token_ids[0] for t in range(20)}
    by_seed = {sample_one(row, p, seed=s).sampled_token_ids[0] for s in range(20)}
    assert len(by_step) >= 15 and len(by_seed) >= 15
    # same seed and step -> same token (recompute after preemption)
    a = sample_one(row, p, output=[1, 2, 3], seed=11).sampled_token_ids
    b = sample_one(row, p, output=[4, 5, 6], seed=11).sampled_token_ids
    assert a == b


def test_empirical_distribution_matches():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 4000
    logits = (probs.log() * 2.0).expand(n, 4).contiguous()  # temperature 2 undoes the * 2
    params = [SamplingParams(temperature=2.0)] * n
    out = Sampler(4)(logits, make_batch(params, seeds=range(10**6, 10**6 + n)))
    freq = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_empirical_distribution_over_steps():
    probs = torch.tensor([0.25, 0.05, 0.6, 0.1])
    n = 4000
    logits = probs.log().expand(n, 4).contiguous()
    outputs = [[0] * (i % 50) for i in range(n)]
    seeds = [12345 + i // 50 for i in range(n)]  # 80 seeds x 50 steps
    out = Sampler(4)(logits, make_batch([SamplingParams()] * n, outputs=outputs, seeds=seeds))
    freq = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_logprobs_are_raw_regardless_of_temperature():
    torch.manual_seed(4)
    logits = torch.randn(4, 30) * 2
    raw_lp = torch.log_softmax(logits, -1)
    params = [
        SamplingParams(temperature=0.3, logprobs=5),
        SamplingParams(temperature=1.7, logprobs=0, top_k=3),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=1.0, logprobs=None, presence_penalty=1.0),
    ]
    out = Sampler(30)(logits, make_batch(params, outputs=[[1, 2]] * 4))
    for i, tok in enumerate(out.sampled_token_ids):
        assert out.sampled_logprobs[i] == pytest.approx(raw_lp[i, tok].item(), abs=1e-5)
        assert out.sampled_ranks[i] == int((logits[i] > logits[i, tok]).sum()) + 1
    assert out.top_logprobs[1] == [] and out.top_logprobs[3] is None
    for i, k in ((0, 5), (2, 2)):
        top = out.top_logprobs[i]
        assert len(top) == k
        vals = [v for _, v in top]
        assert vals == sorted(vals, reverse=True)
        ref_v, ref_i = raw_lp[i].topk(k)
        assert [t for t, _ in top] == ref_i.tolist()
        assert vals == pytest.approx(ref_v.tolist(), abs=1e-5)
    assert out.top_logprobs[2][0][0] == out.sampled_token_ids[2]


def test_compute_prompt_logprobs():
    torch.manual_seed(5)
    logits = torch.randn(5, 20)
    nxt = torch.tensor([3, 0, 19, 7, 7])
    lps, ranks, top = compute_prompt_logprobs(logits, nxt, 3)
    ref = torch.log_softmax(logits, -1)
    assert lps == pytest.approx(ref[torch.arange(5), nxt].tolist(), abs=1e-5)
    assert ranks == [int((logits[j] > logits[j, nxt[j]]).sum()) + 1 for j in range(5)]
    assert all(len(t) == 3 for t in top)
    assert [t[0][0] for t in top] == logits.argmax(-1).tolist()
    _, _, top0 = compute_prompt_logprobs(logits, nxt, 0)
    assert top0 == [[]] * 5


def test_counter_uniform_matches_python_reference():
    from pagedllm.sampling.sampler import _to_i64

    seeds = [0, 1, -1, 2**62 + 12345, -(2**63), 987654321]
    steps = [0, 3, 7, 100, 1, 2**20]
    seed_t = torch.tensor([_to_i64(s) for s in seeds])
    u = counter_uniform(seed_t, torch.tensor(steps), 17)
    assert u.dtype == torch.float32 and u.shape == (6, 17)
    assert bool((u > 0).all() and (u < 1).all())
    for r, (s, t) in enumerate(zip(seeds, steps, strict=True)):
        for v in (0, 1, 16):
            assert u[r, v].item() == counter_uniform_py(s, t, v)
    # explicit id lists give the same values as the full vocabulary
    ids = torch.tensor([[16, 0, 5]] * 6)
    assert torch.equal(counter_uniform(seed_t, torch.tensor(steps), ids), u[:, [16, 0, 5]])
    assert torch.equal(counter_uniform(seed_t, torch.tensor(steps), ids[0]), u[:, [16, 0, 5]])
    # roughly uniform
    big = counter_uniform(torch.tensor([42]), torch.tensor([0]), 100000).double()
    assert abs(big.mean().item() - 0.5) < 0.01
    assert abs(big.var().item() - 1 / 12) < 0.005


def test_top_k_keeps_ties_and_candidate_race_matches_full_race():
    # ties at the k-th value are all kept
    row = [2.0, 1.0, 1.0, 1.0, 0.0, -5.0]
    seen = {
        sample_one(row, SamplingParams(temperature=3.0, top_k=2), seed=s).sampled_token_ids[0]
        for s in range(300)
    }
    assert seen == {0, 1, 2, 3}
    # the race equals a hand-made full-vocabulary exponential race with the same uniforms,
    # both for the candidate-restricted path (top_k) and the full path
    from pagedllm.sampling.sampler import _to_i64

    torch.manual_seed(7)
    V = 400
    logits = torch.randn(V) * 2
    kth = logits.topk(10).values[-1]
    for params, ref_logits in (
        (SamplingParams(top_k=10, temperature=0.7), logits.masked_fill(logits < kth, -1e30)),
        (SamplingParams(temperature=0.7), logits),
    ):
        probs = (ref_logits / 0.7).softmax(-1)
        for seed in range(40):
            u = counter_uniform(torch.tensor([_to_i64(seed)]), torch.tensor([1]), V)[0]
            expected = int((probs / -u.log()).argmax())
            got = sample_one(logits.tolist(), params, seed=seed, output=[1]).sampled_token_ids
            assert got == [expected]


def test_derive_seed():
    assert derive_seed(123, 0) == 123
    seeds = {derive_seed(123, i) for i in range(1, 100)}
    assert len(seeds) == 99 and all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(123, 5) == derive_seed(123, 5) != derive_seed(124, 5)
    with pytest.raises(ValueError):
        derive_seed(1, -1)


def test_errors():
    s = Sampler(10)
    with pytest.raises(ValueError):
        s(torch.zeros(2, 8), make_batch([GREEDY] * 2))
    with pytest.raises(ValueError):
        s(torch.zeros(2, 10), make_batch([GREEDY] * 3))
    with pytest.raises(ValueError):
        s(torch.zeros(1, 10), make_batch([SamplingParams(logit_bias={12: 1.0})]))


def test_large_vocab_mixed_batch_runs():
    torch.manual_seed(6)
    B, V = 16, 49152
    logits = torch.randn(B, V)
    params = [
        SamplingParams(temperature=0.0)
        if i % 3 == 0
        else SamplingParams(temperature=0.9, top_p=0.9)
        for i in range(B)
    ]
    out = Sampler(V)(logits, make_batch(params, outputs=[[1, 2, 3]] * B))
    assert len(out.sampled_token_ids) == B
    assert all(0 <= t < V for t in out.sampled_token_ids)
    assert all(math.isfinite(x) for x in out.sampled_logprobs)
    for i in range(0, B, 3):
        assert out.sampled_token_ids[i] == logits[i].argmax().item()
