"""BeamSearch (pure selection logic) against transformers' beam search on a tiny random Llama.

Each step the tiny HF model is run on every live beam's full token sequence (no KV cache), the
last-position log_softmax goes to ``BeamSearch.step``, and the surviving (parent, token) pairs
become the next live beams.  The finished hypotheses must equal ``generate(num_beams=W, ...)``:
same sequences, same order, same ``sequences_scores``.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch

from pagedllm.engine.beam_search import BeamHypothesis, BeamSearch

PROMPTS = [[5, 17, 42, 99, 7], [3, 250, 11]]
MAX_NEW = 7


def _last_logprobs(model, seqs: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(seqs)).logits[:, -1, :]
    return torch.log_softmax(logits.float(), dim=-1)


def run_ours(model, prompt, w, lp, es, max_new, eos_ids, n) -> tuple[list[BeamHypothesis], int]:
    bs = BeamSearch(w, lp, es, max_new, eos_ids, model.config.vocab_size)
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    steps = 0
    while True:
        kept = bs.step(_last_logprobs(model, [prompt + t for t, _ in beams]), beams)
        steps += 1
        if bs.done:
            assert kept == []
            break
        assert len(kept) == w
        assert steps < max_new
        beams = [(beams[p][0] + [t], c) for p, t, c in kept]
    return bs.finalize(beams, n), steps


def run_hf(model, prompt, w, lp, es, max_new, eos_ids, n, pad_id, logits_processor=None):
    ids = torch.tensor([prompt])
    extra = {} if logits_processor is None else {"logits_processor": logits_processor}
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            num_beams=w,
            do_sample=False,
            length_penalty=lp,
            early_stopping=es,
            max_new_tokens=max_new,
            num_return_sequences=n,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=eos_ids,
            pad_token_id=pad_id,
            **extra,
        )


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The tiny model is faster single-threaded (and the test machine is shared)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def eos_choices(hf_tiny_model):
    """Per prompt, EOS ids the model actually likes (so beams finish early, and whole searches
    stop before max_tokens) and one it dislikes."""
    out = {}
    for pi, prompt in enumerate(PROMPTS):
        first = _last_logprobs(hf_tiny_model, [prompt])[0]
        order = torch.argsort(first, descending=True).tolist()
        seq = list(prompt)
        for _ in range(3):  # greedy path, then the runner-up token at step 4
            seq.append(int(_last_logprobs(hf_tiny_model, [seq])[0].argmax()))
        later_order = torch.argsort(_last_logprobs(hf_tiny_model, [seq])[0], descending=True)
        later = next(t for t in later_order.tolist()[1:] if t != order[1])
        # the tokens most often among the top-8 candidates of a rough 8-wide beam rollout
        counts: Counter[int] = Counter()
        beams = [list(prompt)]
        for _ in range(6):
            lp = _last_logprobs(hf_tiny_model, beams)
            v = lp.shape[1]
            top = torch.topk(lp.flatten(), 8).indices.tolist()
            counts.update(i % v for i in top)
            beams = [beams[i // v] + [i % v] for i in top]
        out[pi] = {
            "first": [order[1]],  # the runner-up first token: a beam ends at step 1
            "later": [later],
            "frequent": [t for t, _ in counts.most_common(3)],  # 3 EOS ids: K = 4 * W
            "none": [order[-1]],  # the least likely first token: (practically) never chosen
        }
    return out


STATS: dict[str, int] = {"eos_finished": 0, "early_done": 0, "runs": 0}


def _check_run(hf_tiny_model, eos_choices, prompt_idx, w, lp, es, eos_kind, n):
    prompt = PROMPTS[prompt_idx]
    eos_ids = eos_choices[prompt_idx][eos_kind]
    pad_id = 1
    ours, steps = run_ours(hf_tiny_model, prompt, w, lp, es, MAX_NEW, eos_ids, n)
    ref = run_hf(hf_tiny_model, prompt, w, lp, es, MAX_NEW, eos_ids, n, pad_id)
    assert len(ours) == n
    _assert_same(ours, ref, prompt, pad_id, lp, eos_ids, MAX_NEW)
    STATS["runs"] += 1
    STATS["eos_finished"] += any(h.finished_by_eos for h in ours)
    STATS["early_done"] += steps < MAX_NEW


def _assert_same(ours, ref, prompt, pad_id, lp, eos_ids, max_new):
    """``ours`` (BeamSearch hypotheses) equal transformers' output ``ref`` for ``prompt``."""
    n = len(ours)
    seqs = ref.sequences.tolist()
    assert len(seqs) == n
    assert ref.sequences.shape[1] - len(prompt) == max(len(h.token_ids) for h in ours)
    for i, h in enumerate(ours):
        assert seqs[i][: len(prompt)] == prompt
        gen = seqs[i][len(prompt) :]
        assert gen[: len(h.token_ids)] == h.token_ids, (i, gen, h.token_ids)
        assert all(t == pad_id for t in gen[len(h.token_ids) :])
        assert h.score == pytest.approx(float(ref.sequences_scores[i]), abs=1e-5)
        assert h.score == pytest.approx(h.cum_logprob / len(h.token_ids) ** lp, abs=1e-5)
        assert h.finished_by_eos == (h.token_ids[-1] in eos_ids)
        assert h.finished_by_eos or len(h.token_ids) == max_new
    scores = [h.score for h in ours]
    assert scores == sorted(scores, reverse=True)


CONFIGS = list(itertools.product([2, 3, 4], [1.0, 0.5, 2.0, 0.0], [True, False, "never"]))


@pytest.mark.parametrize("w,lp,es", CONFIGS)
@pytest.mark.parametrize("eos_kind", ["first", "later", "frequent", "none"])
def test_matches_transformers(hf_tiny_model, eos_choices, w, lp, es, eos_kind):
    n = 1 + (CONFIGS.index((w, lp, es)) % w)  # vary num_return_sequences over 1..W
    _check_run(hf_tiny_model, eos_choices, 0, w, lp, es, eos_kind, n)


@pytest.mark.parametrize("lp", [1.0, 0.5, 0.0])
@pytest.mark.parametrize("es", [True, False, "never"])
@pytest.mark.parametrize("eos_kind", ["first", "frequent", "none"])
def test_matches_transformers_second_prompt(hf_tiny_model, eos_choices, lp, es, eos_kind):
    _check_run(hf_tiny_model, eos_choices, 1, 4, lp, es, eos_kind, 4)


def test_scenarios_were_exercised():
    """The comparisons above covered beams ending on EOS and searches that stopped early."""
    if STATS["runs"] < 20:
        pytest.skip("run together with the comparison tests")
    assert STATS["eos_finished"] > 0
    assert STATS["early_done"] > 0


# ---- hand-made log-probs ------------------------------------------------------------------------
# A "table" maps the generated tokens of a beam to its next log-prob row.  Our side feeds the rows
# to BeamSearch; transformers' side gets them through a logits processor that replaces the model's
# log-probs (generate applies processors after log_softmax), so both run on identical float32
# values -- including exact ties -- and the prompt length can be varied freely.


class _TableProcessor:
    def __init__(self, table, prompt_len: int) -> None:
        self.table, self.prompt_len = table, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        rows = [self.table(seq[self.prompt_len :]) for seq in input_ids.tolist()]
        return torch.stack(rows).to(scores.dtype)


def _row(v: int, probs: dict[int, float]) -> torch.Tensor:
    """A log-prob row with the given token probabilities and the rest spread evenly."""
    rest = (1.0 - sum(probs.values())) / (v - len(probs))
    p = torch.full((v,), rest, dtype=torch.float64)
    for t, q in probs.items():
        p[t] = q
    return p.log().float()


def _tie_table(v: int, salt: int):
    """Pseudo-random rows whose logits take only 4 values: many exact ties everywhere."""

    def table(toks: list[int]) -> torch.Tensor:
        g = torch.Generator().manual_seed((hash((salt, *toks)) & 0x7FFFFFFF) + 1)
        return torch.log_softmax(torch.randint(0, 4, (v,), generator=g).float(), dim=-1)

    return table


def _drive(bs: BeamSearch, table, n: int | None = None) -> list[BeamHypothesis]:
    """Run ``bs`` with log-probs given by ``table(generated_tokens) -> row``."""
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    while True:
        lp = torch.stack([table(t) for t, _ in beams])
        kept = bs.step(lp, beams)
        if bs.done:
            return bs.finalize(beams, n or bs.beam_width)
        beams = [(beams[p][0] + [t], c) for p, t, c in kept]


def _compare_table(model, table, w, lp, es, max_new, eos_ids, n, prompt_lens=(3, 40)):
    """BeamSearch on ``table`` equals transformers for prompts of several lengths."""
    v = model.config.vocab_size
    ours = _drive(BeamSearch(w, lp, es, max_new, eos_ids, v), table, n)
    assert len(ours) == n
    for plen in prompt_lens:
        prompt = [(7 * i + 5) % v for i in range(plen)]
        proc = [_TableProcessor(table, plen)]
        ref = run_hf(model, prompt, w, lp, es, max_new, eos_ids, n, 1, logits_processor=proc)
        _assert_same(ours, ref, prompt, 1, lp, eos_ids, max_new)
    return ours


def test_c16_length_penalty_counts_generated_tokens_only(hf_tiny_model):
    """C16: score = cum_logprob / gen_len ** lp with gen_len the generated length only.

    A finishes at step 2 with cum -2.0 (score -1.0); B finishes at step 4 with cum -3.0 (score
    -0.75), so B ranks first.  Had a 10-token prompt been counted, A (-2/12) would beat B (-3/14).
    transformers agrees for a 3- and a 40-token prompt.
    """
    v, eos = hf_tiny_model.config.vocab_size, 7
    p1, p075 = torch.exp(torch.tensor(-1.0)).item(), torch.exp(torch.tensor(-0.75)).item()

    def table(toks):
        # step 1: token 1 (A) at -1, token 2 (B) at -0.75
        # A: then EOS at -1 (cum -2.0); B: two steps of token 3 at -0.75, then EOS at -0.75
        if not toks:
            return _row(v, {1: p1, 2: p075})
        if toks[0] == 1:
            return _row(v, {eos: p1})
        if toks[0] == 2:
            return _row(v, {3 if len(toks) < 3 else eos: p075})
        return _row(v, {})

    hyps = _compare_table(hf_tiny_model, table, 2, 1.0, "never", 6, [eos], 2)
    assert [h.token_ids for h in hyps] == [[2, 3, 3, eos], [1, eos]]
    assert [h.score for h in hyps] == [pytest.approx(-0.75, abs=1e-5), pytest.approx(-1.0)]


def test_c16_equal_scores_order_independent_of_prompt(hf_tiny_model):
    """Beams with equal generated lengths and logprobs finish with equal scores, in the order
    transformers' topk gives them -- the same for a short and a long prompt."""
    v, w = hf_tiny_model.config.vocab_size, 3

    def table(toks):
        if not toks:  # three exactly tied first tokens
            return _row(v, {4: 0.25, 9: 0.25, 30: 0.25})
        return _row(v, {15: 0.9})  # every beam ends with EOS=15 at step 2

    hyps = _compare_table(hf_tiny_model, table, w, 1.0, False, 5, [15], w, (2, 9, 60))
    assert sorted(h.token_ids[0] for h in hyps) == [4, 9, 30]
    assert hyps[0].score == hyps[1].score == hyps[2].score


@pytest.mark.parametrize(
    "w,lp,es,eos_ids,salt",
    [
        (2, 1.0, False, [3], 0),
        (3, 0.5, True, [3, 8], 1),
        (4, 2.0, "never", [3], 2),
        (4, 0.0, False, [5], 3),
        (3, 1.0, "never", [11, 12, 13], 4),
    ],
)
def test_exact_ties_match_transformers(hf_tiny_model, w, lp, es, eos_ids, salt):
    """Tie-breaking (topk over the flat beam*V index, finished-slot merge) matches exactly."""
    v = hf_tiny_model.config.vocab_size
    _compare_table(hf_tiny_model, _tie_table(v, salt), w, lp, es, 6, eos_ids, w, (4,))


def test_first_step_matches_w_copies_of_prompt():
    """One live beam on the first step behaves like transformers' W prompt copies (the
    copies 1.. at -1e9 never contribute): all children come from row 0."""
    v = 10
    lp = torch.log_softmax(torch.tensor([[0.0, 3.0, 1.0, 2.5, 2.0, 0.5, 0.0, 0.0, 1.0, 0.0]]), -1)
    bs = BeamSearch(3, 1.0, False, 4, [9], v)
    kept = bs.step(lp, [([], 0.0)])
    assert [(p, t) for p, t, _ in kept] == [(0, 1), (0, 3), (0, 4)]
    assert [c for _, _, c in kept] == [pytest.approx(lp[0, t].item()) for t in (1, 3, 4)]


def test_eos_outside_top_w_is_dropped_and_max_tokens_finishes(hf_tiny_model):
    """An EOS candidate ranked below W is not a finished hypothesis; at max_tokens the best W
    running continuations become the finished ones."""
    v, eos = hf_tiny_model.config.vocab_size, 5

    def table(toks):
        if not toks:
            return _row(v, {0: 0.4, 1: 0.3, eos: 0.2})  # EOS ranks 3rd of W=2 -> dropped
        return _row(v, {2: 0.5, 3: 0.4})

    hyps = _compare_table(hf_tiny_model, table, 2, 1.0, False, 2, [eos], 2)
    assert [h.token_ids for h in hyps] == [[0, 2], [0, 3]]
    assert not any(h.finished_by_eos for h in hyps)


def test_finalize_before_done_adds_running_beams():
    """A search cut short (not ``done``) returns the live beams, scored at their length."""
    v = 10
    lp = torch.log_softmax(torch.tensor([[0.0, 3.0, 1.0, 2.5, 2.0, 0.5, 0.0, 0.0, 1.0, 0.0]]), -1)
    bs = BeamSearch(2, 1.0, False, 5, [9], v)
    kept = bs.step(lp, [([], 0.0)])
    assert not bs.done
    hyps = bs.finalize([([t], c) for _, t, c in kept], 2)
    assert [h.token_ids for h in hyps] == [[1], [3]]
    assert [h.score for h in hyps] == [
        pytest.approx(lp[0, 1].item()),
        pytest.approx(lp[0, 3].item()),
    ]
    assert bs.done


@pytest.mark.parametrize("lp", [-1000.0, -10.0, 80.0, 1000.0, 1e20])
def test_extreme_length_penalty_still_returns_every_beam(lp):
    """A length penalty whose scores leave transformers' -1e9 "impossible" scale (negative:
    cum_logprob * gen_len ** -lp below -1e9) or the float range (gen_len ** 1000 overflows, which
    raised OverflowError inside the engine step and failed every request in flight) still
    finishes W hypotheses with finite scores, ranked as the penalty says where it is finite."""
    v, eos, w = 12, 11, 3

    def table(toks):
        g = torch.Generator().manual_seed(len(toks) * 131 + sum(toks) + 7)
        row = torch.randn(v, generator=g) * 2
        row[eos] = -1.0 if len(toks) >= 3 else -30.0  # EOS becomes likely after 3 tokens
        return torch.log_softmax(row, dim=-1)

    hyps = _drive(BeamSearch(w, lp, False, 8, [eos], v), table)
    assert len(hyps) == w
    assert all(math.isfinite(h.score) and h.token_ids for h in hyps)
    assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
    if lp == -10.0:  # finite: each score is cum_logprob / len ** lp, computed in float32
        for h in hyps:
            want = torch.tensor(h.cum_logprob, dtype=torch.float32) / len(h.token_ids) ** lp
            assert h.score == pytest.approx(want.item(), rel=1e-6)


def test_invalid_arguments():
    with pytest.raises(ValueError):
        BeamSearch(2, 1.0, "sometimes", 4, [0], 10)
    with pytest.raises(ValueError):
        BeamSearch(0, 1.0, True, 4, [0], 10)
    bs = BeamSearch(2, 1.0, True, 4, [0], 10)
    with pytest.raises(ValueError):
        bs.step(torch.zeros(1, 9), [([], 0.0)])
    with pytest.raises(ValueError):
        bs.finalize([([], 0.0)], 3)
