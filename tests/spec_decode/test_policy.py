"""The goodput rule that trims n-gram / suffix proposals per step (spec_decode.policy)."""

import pytest

from pagedllm.spec_decode.policy import DraftAllocator


def test_below_the_knee_every_draft_is_kept():
    alloc = DraftAllocator(knee_rows=16, row_cost=0.5, prior=0.6)
    assert alloc.allocate({1: 4, 2: 4, 3: 0}, num_rows=3) == {1: 4, 2: 4, 3: 0}  # 11 rows


def test_past_the_knee_drafts_are_kept_by_value():
    alloc = DraftAllocator(knee_rows=8, row_cost=0.1, smoothing=1.0)
    for seq_id in range(4):
        alloc.record(seq_id, 4, 4)  # alpha 1.0: every draft worth a token
    for seq_id in range(4, 8):
        alloc.record(seq_id, 4, 1)  # alpha 0.5
    assert alloc.alpha(0) == 1.0 and alloc.alpha(4) == 0.5
    # 8 rows are free; each row past them costs 0.1 of a step. A certain draft keeps the
    # goodput rising ((n + 1) / T(n + 1) > n / T(n) with n rows = n tokens), so all 16 are
    # kept (24 rows, T = 2.6); a 0.5 draft would lower it (24.5 / 2.7 < 24 / 2.6).
    kept = alloc.allocate({i: 4 for i in range(8)}, num_rows=8)
    assert kept == {0: 4, 1: 4, 2: 4, 3: 4, 4: 0, 5: 0, 6: 0, 7: 0}
    # With fewer certain drafts the knee's free rows go to the likeliest ones first.
    kept = DraftAllocator(knee_rows=12, row_cost=10.0, prior=0.5).allocate({1: 4, 2: 4}, 8)
    assert kept == {1: 2, 2: 2}  # rows 9-12: the two 0.5 drafts, then the two 0.25 drafts


def test_min_value_and_prefixes():
    alloc = DraftAllocator(knee_rows=64, prior=0.5, min_value=0.2)
    assert alloc.allocate({7: 4}, num_rows=1) == {7: 2}  # 0.5, 0.25 kept; 0.125 not


def test_alpha_moving_average_and_recovery():
    alloc = DraftAllocator(knee_rows=1, row_cost=1.0, prior=0.6, smoothing=0.5)
    alloc.record(1, 4, 0)
    assert alloc.alpha(1) == pytest.approx(0.3)
    alloc.record(1, 4, 2)  # estimate 2 / 3
    assert alloc.alpha(1) == pytest.approx(0.3 + 0.5 * (2 / 3 - 0.3))
    alloc.record(1, 0, 0)  # nothing verified: no change
    assert alloc.alpha(1) == pytest.approx(0.48333333)
    # A dropped proposal pulls alpha back towards the prior.
    assert alloc.allocate({1: 3}, num_rows=4) == {1: 0}
    assert alloc.alpha(1) == pytest.approx(0.48333333 + 0.5 * (0.6 - 0.48333333))
    alloc.forget(1)
    assert alloc.alpha(1) == 0.6


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"knee_rows": 0}, "knee_rows"), ({"row_cost": -1}, "row_cost"), ({"prior": 2}, "prior"),
     ({"smoothing": 0}, "smoothing"), ({"min_value": -0.1}, "min_value")],
)
def test_bad_arguments_name_the_field(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DraftAllocator(**kwargs)


def test_speculator_takes_the_cost_model_from_the_config():
    from pagedllm.spec_decode.config import parse_speculative_config
    from pagedllm.spec_decode.speculator import Speculator

    cfg = parse_speculative_config({"method": "ngram", "step_rows_knee": 12, "step_row_cost": 0.5})
    spec = Speculator(cfg, max_model_len=64)
    assert spec.allocator is not None
    assert (spec.allocator.knee_rows, spec.allocator.row_cost) == (12, 0.5)
    with pytest.raises(ValueError, match="speculative_config.step_row_cost"):
        parse_speculative_config({"step_row_cost": -0.1})
    with pytest.raises(ValueError, match="speculative_config.step_rows_knee"):
        parse_speculative_config({"step_rows_knee": 0})
