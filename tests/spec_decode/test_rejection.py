"""Rejection sampler: exact target distribution (chi-square over seeded draws), acceptance
probability min(1, p/q), bonus / recovered tokens, padding rows, reproducibility, errors."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.sampling.sampler import counter_uniform
from pagedllm.spec_decode.rejection import rejection_sample, rejection_seed

V = 12
N = 20000  # seeded draws per statistical check (one row per draw, all in one call)


def _probs(gen: torch.Generator, rows: int, vocab: int = V) -> torch.Tensor:
    """[rows, vocab] float32 distributions with every entry >= ~0.02 (expected counts >= 5)."""
    w = torch.rand(rows, vocab, generator=gen) + 0.3
    return w / w.sum(dim=-1, keepdim=True)


def _chi2_critical(df: int, z: float = 3.29) -> float:
    """Upper chi-square quantile (Wilson-Hilferty), z = 3.29 -> p = 0.0005."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def _assert_follows(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    """Chi-square goodness of fit of int64 ``tokens`` against the 1-D distribution ``probs``."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    support = expected > 0
    assert counts[~support].sum() == 0, "a token with zero target probability was emitted"
    chi2 = float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())
    df = int(support.sum()) - 1
    assert chi2 < _chi2_critical(df), (chi2, df, counts.tolist(), expected.tolist())


def _same_rows(p: torch.Tensor, n: int) -> torch.Tensor:
    return p[None].expand(n, *p.shape).contiguous()


def test_one_hot_drafts_follow_target() -> None:
    gen = torch.Generator().manual_seed(0)
    k = 2
    p = _probs(gen, k + 1)  # [k+1, V], the same for every row
    drafts = torch.tensor([[3, 7]] * N)
    out, acc = rejection_sample(
        _same_rows(p, N), drafts, torch.full((N,), k), None, list(range(N)), [5] * N
    )
    _assert_follows(out[:, 0], p[0])
    # Rows that accepted draft 0 emit their second token from p[1] (the row's next position).
    _assert_follows(out[acc >= 1, 1], p[1])
    assert torch.equal(out[:, 0] == 3, acc >= 1)
    # Acceptance probability of a deterministic draft is p(x).
    _assert_rate(int((acc >= 1).sum()), N, float(p[0, 3]))


def _assert_rate(hits: int, n: int, rate: float) -> None:
    sd = math.sqrt(n * rate * (1 - rate)) + 1e-9
    assert abs(hits - n * rate) < 4.5 * sd, (hits, n * rate)


def test_random_draft_probs_follow_target() -> None:
    gen = torch.Generator().manual_seed(1)
    k = 3
    p = _probs(gen, k + 1)
    q = _probs(gen, k)
    drafts = torch.stack(
        [torch.multinomial(q[j], N, replacement=True, generator=gen) for j in range(k)], 1
    )
    out, acc = rejection_sample(
        _same_rows(p, N), drafts, torch.full((N,), k), _same_rows(q, N), list(range(N)), [0] * N
    )
    _assert_follows(out[:, 0], p[0])
    _assert_follows(out[acc >= 1, 1], p[1])
    _assert_follows(out[acc >= 2, 2], p[2])
    assert ((out >= 0).sum(dim=1) == acc + 1).all()


def test_draft_sampled_with_request_seed_stays_exact() -> None:
    """A draft model drawing with the request's own (seed, step) counters through the sampler's
    race must not bias the output: the rejection sampler uses a separate stream."""
    gen = torch.Generator().manual_seed(2)
    p = _probs(gen, 2)
    q = _probs(gen, 1)
    seeds = list(range(N))
    seed_t = torch.tensor(seeds)
    step_t = torch.zeros(N, dtype=torch.int64)
    expo = counter_uniform(seed_t, step_t, V).log_().neg_()
    drafts = (q[0][None] / expo).argmax(dim=1, keepdim=True)
    _assert_follows(drafts[:, 0], q[0])  # the draft really is sampled from q
    out, _ = rejection_sample(
        _same_rows(p, N), drafts, torch.ones(N, dtype=torch.int64), _same_rows(q, N), seeds, [0] * N
    )
    _assert_follows(out[:, 0], p[0])
    assert rejection_seed(7) != 7


@pytest.mark.parametrize(("p_x", "q_x"), [(0.1, 0.4), (0.3, 0.15)])
def test_acceptance_probability_is_min_one_p_over_q(p_x: float, q_x: float) -> None:
    p = torch.full((2, V), (1 - p_x) / (V - 1))
    p[0, 4] = p_x
    q = torch.full((1, V), (1 - q_x) / (V - 1))
    q[0, 4] = q_x
    drafts = torch.full((N, 1), 4)
    _, acc = rejection_sample(
        _same_rows(p, N),
        drafts,
        torch.ones(N, dtype=torch.int64),
        _same_rows(q, N),
        list(range(N)),
        [3] * N,
    )
    rate = min(1.0, p_x / q_x)
    if rate == 1.0:
        assert int(acc.sum()) == N
    else:
        _assert_rate(int(acc.sum()), N, rate)


def test_all_accepted_emits_bonus_from_row_num_draft() -> None:
    gen = torch.Generator().manual_seed(3)
    k = 3
    bonus = _probs(gen, 1)[0]
    drafts = torch.tensor([[1, 2, 3]] * N)
    # Row i has num_draft = i % 4; its drafts are certain under the target (one-hot p) and its
    # target row num_draft[i] is ``bonus``, so it must emit all drafts then a bonus ~ bonus.
    nd = torch.arange(N) % (k + 1)
    p = torch.zeros(N, k + 1, V)
    p[:, torch.arange(k), drafts[0]] = 1.0
    p[torch.arange(N), nd] = bonus
    out, acc = rejection_sample(p, drafts, nd, None, list(range(N)), [0] * N)
    assert torch.equal(acc, nd)
    for j in range(k + 1):
        rows = nd == j
        assert torch.equal(out[rows, :j], drafts[rows, :j])
        assert (out[rows, j + 1 :] == -1).all()
        _assert_follows(out[rows, j], bonus)


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_one_hot_target_is_greedy_verification(with_draft_probs: bool) -> None:
    k = 4
    target = torch.tensor([5, 6, 7, 8, 9])  # argmax at each position
    p = torch.zeros(3, k + 1, V)
    p[:, torch.arange(k + 1), target] = 1.0
    drafts = torch.tensor([[5, 6, 0, 8], [5, 6, 7, 8], [1, -1, -1, -1]])
    nd = torch.tensor([4, 4, 1])
    q = torch.full((3, k, V), 1.0 / V) if with_draft_probs else None
    for seed in range(20):
        out, acc = rejection_sample(p, drafts, nd, q, [seed] * 3, [seed] * 3)
        assert acc.tolist() == [2, 4, 0]
        assert out.tolist() == [
            [5, 6, 7, -1, -1],
            [5, 6, 7, 8, 9],
            [5, -1, -1, -1, -1],
        ]


def test_rows_without_drafts_sample_target_row_zero() -> None:
    gen = torch.Generator().manual_seed(4)
    k = 2
    p = _probs(gen, k + 1)
    drafts = torch.full((N, k), -1)
    out, acc = rejection_sample(
        _same_rows(p, N), drafts, torch.zeros(N, dtype=torch.int64), None, list(range(N)), [9] * N
    )
    assert (acc == 0).all() and (out[:, 1:] == -1).all()
    _assert_follows(out[:, 0], p[0])
    # k = 0 (no speculation at all) works the same way.
    out0, acc0 = rejection_sample(
        _same_rows(p[:1], N),
        torch.empty(N, 0, dtype=torch.int64),
        torch.zeros(N, dtype=torch.int64),
        None,
        list(range(N)),
        [9] * N,
    )
    assert torch.equal(out0[:, 0], out[:, 0]) and (acc0 == 0).all()


def test_reproducible_and_batch_independent() -> None:
    gen = torch.Generator().manual_seed(5)
    n, k = 64, 3
    p = _probs(gen, n * (k + 1)).view(n, k + 1, V)
    q = _probs(gen, n * k).view(n, k, V)
    drafts = torch.randint(0, V, (n, k), generator=gen)
    nd = torch.randint(0, k + 1, (n,), generator=gen)
    seeds = [1000 + i for i in range(n)]
    steps = [i % 7 for i in range(n)]
    out1, acc1 = rejection_sample(p, drafts, nd, q, seeds, steps)
    out2, acc2 = rejection_sample(p, drafts, nd, q, seeds, steps)
    assert torch.equal(out1, out2) and torch.equal(acc1, acc2)
    # A row's result depends only on its own inputs, not on the other rows of the batch.
    sub = torch.arange(n - 1, -1, -3)
    out3, acc3 = rejection_sample(
        p[sub], drafts[sub], nd[sub], q[sub], [seeds[i] for i in sub], [steps[i] for i in sub]
    )
    assert torch.equal(out3, out1[sub]) and torch.equal(acc3, acc1[sub])
    # Other steps draw other uniforms.
    out4, _ = rejection_sample(p, drafts, nd, q, seeds, [s + 100 for s in steps])
    assert not torch.equal(out4, out1)


def test_errors_name_the_argument() -> None:
    p = torch.full((2, 3, V), 1.0 / V)
    d = torch.zeros(2, 2, dtype=torch.int64)
    nd = torch.tensor([2, 1])
    ok = dict(
        target_probs=p,
        draft_token_ids=d,
        num_draft=nd,
        draft_probs=None,
        seeds=[0, 1],
        steps=[0, 0],
    )
    bad = [
        ("target_probs", {"target_probs": torch.ones(2, V)}),
        ("draft_token_ids", {"draft_token_ids": torch.zeros(2, 3, dtype=torch.int64)}),
        ("draft_token_ids", {"draft_token_ids": d.int()}),
        ("draft_token_ids", {"draft_token_ids": torch.tensor([[0, V], [0, 0]])}),
        ("num_draft", {"num_draft": torch.tensor([3, 0])}),
        ("num_draft", {"num_draft": torch.tensor([1])}),
        ("draft_probs", {"draft_probs": torch.ones(2, 2, V + 1)}),
        ("seeds", {"seeds": [0]}),
        ("steps", {"steps": [0, 0, 0]}),
        ("steps", {"steps": [0, -1]}),
    ]
    for name, change in bad:
        with pytest.raises(ValueError, match=name):
            rejection_sample(**{**ok, **change})  # type: ignore[arg-type]
    # Padding beyond num_draft may hold anything (here V, out of range): it is ignored.
    out, acc = rejection_sample(p, torch.tensor([[0, 1], [2, V]]), nd, None, [0, 1], [0, 0])
    assert out.shape == (2, 3) and acc.shape == (2,)
