"""The n-gram proposer, the speculative config and request validation (issue 25)."""

import random

import pytest

from pagedllm.config import EngineConfig
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.config import SpeculativeConfig, parse_speculative_config
from pagedllm.spec_decode.proposer import NgramProposer, make_proposer


def test_ngram_proposes_what_followed_the_latest_match():
    p = NgramProposer(min_n=1, max_n=3)
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    # The last 3 tokens (1 2 3) match at 5..7 (latest) -> 7 8 1 2
    assert p.propose(tokens, 4, 4, "r") == [7, 8, 1, 2]
    assert p.propose(tokens, 4, 2, "r") == [7, 8]
    # No 3- or 2-gram match; the 1-gram 5 matches at index 0 -> what follows it.
    assert p.propose([5, 6, 4, 4, 5], 2, 3, "r") == [6, 4, 4]
    assert p.propose([1, 2, 3], 3, 4, "r") == []  # nothing repeats
    assert p.propose([1, 1], 1, 0, "r") == []
    # min_n 2: a 1-gram match is not enough.
    assert NgramProposer(min_n=2, max_n=3).propose([5, 6, 4, 4, 5], 2, 3, "r") == []


def test_ngram_longest_match_wins():
    p = NgramProposer(min_n=1, max_n=2)
    # 2-gram (3, 4) matches at 0 -> 5; the 1-gram 4 alone would match at index 6 -> 0.
    assert p.propose([3, 4, 5, 1, 2, 9, 4, 0, 3, 4], 0, 1, "r") == [5]


def test_ngram_reports_the_match_length():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert NgramProposer(1, 3).propose_matched(tokens, 4, 4, "r") == ([7, 8, 1, 2], 3)
    assert NgramProposer(1, 2).propose_matched(tokens, 4, 4, "r") == ([7, 8, 1, 2], 2)  # capped
    assert NgramProposer(1, 3).propose_matched([5, 6, 4, 4, 5], 2, 3, "r") == ([6, 4, 4], 1)
    assert NgramProposer(1, 3).propose_matched([1, 2, 3], 3, 4, "r") == ([], 0)
    assert NgramProposer(2, 3).propose_matched([5, 6, 4, 4, 5], 2, 3, "r") == ([], 0)


def test_config_parsing_and_errors():
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert cfg == SpeculativeConfig(num_speculative_tokens=3)
    assert parse_speculative_config(None) is None
    assert isinstance(make_proposer(cfg), NgramProposer)
    with pytest.raises(ValueError, match="speculative_config must be a JSON object"):
        parse_speculative_config("{nope")
    with pytest.raises(ValueError, match="unknown key"):
        parse_speculative_config({"method": "ngram", "k": 3})
    with pytest.raises(ValueError, match="speculative_config.method"):
        parse_speculative_config({"method": "eagle"})
    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens"):
        parse_speculative_config({"num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        parse_speculative_config({"prompt_lookup_min": 5, "prompt_lookup_max": 2})
    # Without a method, vLLM's inference: a named model is a draft model, else n-gram lookup.
    assert parse_speculative_config({"num_speculative_tokens": 2}).method == "ngram"
    ngram = parse_speculative_config({"model": "[ngram]", "num_speculative_tokens": 2})
    assert (ngram.method, ngram.model) == ("ngram", None)
    draft = parse_speculative_config({"model": "some/draft", "num_speculative_tokens": 2})
    assert (draft.method, draft.model) == ("draft_model", "some/draft")
    with pytest.raises(ValueError, match="only used with method 'draft_model', not 'suffix'"):
        parse_speculative_config({"method": "suffix", "model": "some/draft"})
    with pytest.raises(ValueError, match="speculative_config needs kv_manager"):
        EngineConfig(speculative_config='{"method": "ngram"}', kv_manager="orca-max")


def test_sampling_params_validation():
    assert SamplingParams(num_speculative_tokens=0).num_speculative_tokens == 0
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer"):
        SamplingParams(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer"):
        SamplingParams(num_speculative_tokens=2.5)
    with pytest.raises(ValueError, match="num_speculative_tokens is not supported with use_beam_search"):
        SamplingParams(num_speculative_tokens=2, use_beam_search=True, n=2, temperature=0)


def _brute_force(ids, k, min_n, max_n):
    """Longest n first, most recent start first: the definition, spelled out."""
    total = len(ids)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        for start in range(total - n - 1, -1, -1):
            if ids[start : start + n] == ids[total - n :]:
                return ids[start + n : start + n + k]
    return []


def test_ngram_equals_brute_force_on_random_sequences():
    rng = random.Random(0)
    for _ in range(2000):
        ids = [rng.randrange(4) for _ in range(rng.randint(0, 30))]
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        k = rng.randint(1, 5)
        assert NgramProposer(lo, hi).propose(ids, 0, k, "r") == _brute_force(ids, k, lo, hi)
