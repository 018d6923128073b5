"""Suffix proposer: exact proposals on hand-made sequences, frequency threshold, incremental
updates equal to a brute-force reference, cross-request reuse, eviction bound, errors."""

from __future__ import annotations

import random

import pytest

from pagedllm.spec_decode.suffix import SuffixProposer


def test_copies_the_continuation_of_the_longest_match() -> None:
    sp = SuffixProposer()
    assert sp.propose([1, 2, 3, 4, 5, 1, 2], 5, 3, "r") == [3, 4, 5]
    # The continuation may run into the sequence's own tail and stops at its end.
    assert sp.propose([7, 8, 9, 7, 8], 3, 6, "p") == [9, 7, 8]
    # Longest match wins over a more recent shorter one: "5 1 2" occurs once, followed by 6.
    seq = [5, 1, 2, 6, 0, 1, 2, 9, 5, 1, 2]
    assert sp.propose(seq, 11, 1, "q") == [6]
    assert sp.propose([4, 4, 4, 3], 4, 3, "none") == []  # 3 never occurred before
    assert sp.propose([1, 2], 2, 0, "zero") == []


def test_reports_the_length_of_the_matched_suffix() -> None:
    sp = SuffixProposer()
    assert sp.propose_matched([1, 2, 3, 4, 5, 1, 2], 5, 3, "r") == ([3, 4, 5], 2)
    assert sp.propose_matched([5, 1, 2, 6, 0, 1, 2, 9, 5, 1, 2], 11, 1, "q") == ([6], 3)
    assert sp.propose_matched([4, 4, 4, 3], 4, 3, "none") == ([], 0)
    # A match whose continuation falls under min_token_prob proposes nothing: length 0.
    seq = [9, 1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 9, 1, 2]
    assert SuffixProposer(min_token_prob=0.7).propose_matched(seq, len(seq), 5, "a") == ([], 0)


def test_most_frequent_continuation_and_threshold() -> None:
    # "9 1 2" is followed by 3, 3, 4 (shares 2/3 and 1/3); after "9 1 2 3" by 9, 1, 2, then
    # 3 or 4 (a tie, the newest occurrence wins; probability 2/3 * 1/2).
    seq = [9, 1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 9, 1, 2]
    assert SuffixProposer().propose(seq, len(seq), 5, "a") == [3, 9, 1, 2, 4]
    assert SuffixProposer(min_token_prob=0.4).propose(seq, len(seq), 5, "a") == [3, 9, 1, 2]
    assert SuffixProposer(min_token_prob=0.7).propose(seq, len(seq), 5, "a") == []
    assert SuffixProposer(max_depth=2).propose(seq, len(seq), 5, "a") == [3, 9]
    # Two-way split at depth 1 after a certain depth 0: probability 1 * 1/2.
    seq2 = [1, 2, 5, 1, 2, 6, 1]
    assert SuffixProposer(min_token_prob=0.5).propose(seq2, 7, 3, "b") == [2, 6, 1]  # newest
    assert SuffixProposer(min_token_prob=0.6).propose(seq2, 7, 3, "b") == [2]


def test_speculation_length_follows_the_match_length() -> None:
    seq = [1, 2, 3, 4, 5, 6, 7, 9, 2, 3]  # "2 3" matches (2 tokens), then 4 5 6 7
    assert SuffixProposer().propose(seq, 10, 4, "a") == [4, 5, 6, 7]
    assert SuffixProposer(max_spec_factor=1.0).propose(seq, 10, 4, "a") == [4, 5]
    assert SuffixProposer(max_spec_factor=0.4).propose(seq, 10, 4, "a") == [4]


def _reference(seq: list[int], outputs: list[list[int]], k: int, sp: SuffixProposer) -> list[int]:
    """Brute force: every occurrence of every suffix (newest first), longest match, greedy walk."""
    docs = [seq, *reversed(outputs)]
    found = []
    for doc in docs:
        for pos in range(len(doc) - 2, -1, -1):
            m = 0
            while m < sp.max_match_len and m <= pos and doc[pos - m] == seq[len(seq) - 1 - m]:
                m += 1
            if m:
                found.append((m, doc, pos + 1))
    if not found:
        return []
    best = max(m for m, _, _ in found)
    starts = [(doc, s) for m, doc, s in found if m == best]
    out: list[int] = []
    prob = 1.0
    for d in range(min(k, sp.max_depth)):
        nxt = [doc[s + d] for doc, s in starts if s + d < len(doc)]
        if not nxt:
            break
        tok = max(dict.fromkeys(nxt), key=nxt.count)
        prob *= nxt.count(tok) / len(nxt)
        if prob < sp.min_token_prob:
            break
        out.append(tok)
        starts = [(doc, s) for doc, s in starts if s + d < len(doc) and doc[s + d] == tok]
    return out


@pytest.mark.parametrize("min_token_prob", [0.0, 0.3])
def test_incremental_equals_brute_force(min_token_prob: float) -> None:
    rng = random.Random(0)
    sp = SuffixProposer(max_depth=5, min_token_prob=min_token_prob, max_match_len=4)
    outputs: list[list[int]] = []
    for r in range(4):
        seq = [rng.randrange(4) for _ in range(6)]
        for _ in range(30):
            got = sp.propose(seq, 6, 4, f"r{r}")
            assert got == _reference(seq, outputs, 4, sp), (seq, outputs)
            # Accept a random prefix of the proposal plus one token (like a verify step).
            seq += got[: rng.randrange(len(got) + 1)] + [rng.randrange(4)]
        sp.on_request_finished(seq, 6, f"r{r}")
        outputs.append(seq[6:])
        assert sp.num_active_requests == 0


def test_rebuilds_when_the_sequence_is_not_an_extension() -> None:
    sp = SuffixProposer()
    assert sp.propose([1, 2, 3, 1, 2], 2, 2, "s") == [3, 1]
    # Same id, different history (e.g. a reused key): must not see the old tokens.
    assert sp.propose([4, 5, 6, 4], 2, 2, "s") == [5, 6]
    assert sp.propose([1, 2], 2, 2, "s") == []


def test_cross_request_reuse_uses_outputs_not_prompts() -> None:
    sp = SuffixProposer()
    prompt = [100, 101, 102, 103]
    output = [50, 51, 52, 53, 54, 55]
    sp.propose(prompt + output, 4, 3, "a")
    sp.on_request_finished(prompt + output, 4, "a")
    assert sp.num_cached_requests == 1 and sp.num_active_requests == 0
    assert sp.propose([7, 8, 51, 52], 4, 3, "b") == [53, 54, 55]
    assert sp.propose([7, 8, 100, 101], 4, 3, "c") == []  # the finished prompt is not cached
    # The request's own history wins ties with the cache (newest first): 52 -> 99 locally.
    assert sp.propose([51, 52, 99, 51, 52], 5, 1, "d") == [99]


def test_eviction_keeps_the_newest_outputs() -> None:
    sp = SuffixProposer(max_cached_requests=2)
    for i in range(3):
        out = [10 * i + 1, 10 * i + 2, 10 * i + 3]
        sp.on_request_finished([0, *out], 1, f"r{i}")
    assert sp.num_cached_requests == 2
    assert sp.propose([9, 1, 2], 3, 1, "x") == []  # r0 evicted
    assert sp.propose([9, 11, 12], 3, 1, "y") == [13]
    assert sp.propose([9, 21, 22], 3, 1, "z") == [23]
    off = SuffixProposer(max_cached_requests=0)
    off.on_request_finished([0, 1, 2, 3], 1, "r")
    assert off.num_cached_requests == 0


def test_errors_name_the_argument() -> None:
    for kwargs, name in [
        ({"max_depth": 0}, "max_depth"),
        ({"max_cached_requests": -1}, "max_cached_requests"),
        ({"min_token_prob": 1.5}, "min_token_prob"),
        ({"max_match_len": 0}, "max_match_len"),
        ({"max_spec_factor": -1.0}, "max_spec_factor"),
    ]:
        with pytest.raises(ValueError, match=name):
            SuffixProposer(**kwargs)  # type: ignore[arg-type]
    sp = SuffixProposer()
    with pytest.raises(ValueError, match="k must"):
        sp.propose([1, 2], 1, -1, "r")
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        sp.propose([1, 2], 3, 1, "r")
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        sp.on_request_finished([1, 2], -1, "r")
