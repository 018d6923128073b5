"""Validation and helpers of SamplingParams."""

from __future__ import annotations

import math

import pytest

from pagedllm.sampling_params import SamplingParams, SamplingType


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.1),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", math.nan),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.inf),
        ("n", 0),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("prompt_logprobs", -1),
        ("stop", [""]),
        ("stop", ""),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["a"]),
        ("logit_bias", {"abc": 1.0}),
        ("logit_bias", {5: math.nan}),
        ("logit_bias", {-1: 1.0}),
        ("seed", 1.5),
        ("seed", 2**64 + 5),  # would wrap onto seed 5
        ("seed", 2**63),
        ("seed", -(2**63) - 1),
        ("early_stopping", "sometimes"),
        ("length_penalty", math.inf),
    ],
)
def test_invalid_value_names_field(field, value):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**{field: value})
    assert str(exc.value).startswith(field), str(exc.value)


def test_seed_takes_the_int64_range():
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_error_message_format():
    with pytest.raises(ValueError, match=r"^temperature must be non-negative and finite, got -1$"):
        SamplingParams(temperature=-1)


def test_cross_field_checks():
    with pytest.raises(ValueError, match="^best_of"):
        SamplingParams(n=3, best_of=2)
    SamplingParams(n=2, best_of=4)
    with pytest.raises(ValueError, match="^min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    SamplingParams(max_tokens=None, min_tokens=100)
    SamplingParams(max_tokens=5, min_tokens=5)


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert p.n == 1 and p.max_tokens == 16 and p.temperature == 1.0 and p.top_k == 0
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias is None
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(early_stopping="never").early_stopping == "never"


def test_logit_bias_keys_and_range():
    p = SamplingParams(logit_bias={"123": 5, 7: -100.0, "8": 100, "0042": 0.5})
    assert p.logit_bias == {123: 5.0, 7: -100.0, 8: 100.0, 42: 0.5}
    assert all(isinstance(k, int) for k in p.logit_bias)
    # Out of OpenAI's [-100, 100]: refused, never clamped (was clamped to +-100 silently).
    for bad in ({7: -250.0}, {"8": 300}, {"1": 100.001}, {"1": -100.5}):
        with pytest.raises(ValueError, match=r"^logit_bias values must be in \[-100, 100\]"):
            SamplingParams(logit_bias=bad)
    # Keys are ASCII decimal token ids: int() would also take these (was accepted).
    for key in (" 1", "+1", "1_0", "\u0665", "1" * 65):
        with pytest.raises(ValueError, match=r"^logit_bias keys must be token ids \(integers\)"):
            SamplingParams(logit_bias={key: 1.0})


def test_verify_token_ids():
    SamplingParams(stop_token_ids=[0, 9], logit_bias={9: 1.0}).verify_token_ids(10)
    with pytest.raises(ValueError, match="^stop_token_ids"):
        SamplingParams(stop_token_ids=[10]).verify_token_ids(10)
    with pytest.raises(ValueError, match="^logit_bias"):
        SamplingParams(logit_bias={"10": 1.0}).verify_token_ids(10)


def test_sampling_type():
    assert SamplingParams(temperature=0.0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6).sampling_type == SamplingType.GREEDY
    assert SamplingParams(top_k=1).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=0.7).sampling_type == SamplingType.RANDOM
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED


def test_stop_helpers():
    p = SamplingParams(stop=["a", "xyz"], stop_token_ids=[5])
    assert p.max_stop_str_len == 3
    assert SamplingParams().max_stop_str_len == 0
    assert p.all_stop_token_ids([2, 3]) == {2, 3, 5}
    assert SamplingParams(stop_token_ids=[5], ignore_eos=True).all_stop_token_ids([2]) == {5}


def test_clone_is_deep():
    p = SamplingParams(stop=["a"], stop_token_ids=[1], logit_bias={1: 2.0})
    q = p.clone()
    assert q == p
    q.stop.append("b")
    q.stop_token_ids.append(2)
    q.logit_bias[3] = 1.0
    assert p.stop == ["a"] and p.stop_token_ids == [1] and p.logit_bias == {1: 2.0}


@pytest.mark.parametrize(("field", "value"), [("stop", 5), ("stop", {"a"}), ("stop_token_ids", 5)])
def test_stop_fields_of_the_wrong_type_name_the_field(field, value):
    """Were a TypeError from list(5) (a set's order would make the stops' order arbitrary)."""
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**{field: value})


def test_stop_token_ids_from_an_array():
    import numpy as np
    import torch

    assert SamplingParams(stop_token_ids=np.array([2, 5])).stop_token_ids == [2, 5]
    assert SamplingParams(stop_token_ids=torch.tensor([7])).stop_token_ids == [7]
