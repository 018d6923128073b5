"""The goodput rule that trims n-gram / suffix proposals per step (spec_decode.policy)."""

import pytest

from pagedllm.spec_decode.policy import DraftAllocator, MatchAcceptance, StepCostTable


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


def test_match_acceptance_counts_by_match_length_and_depth():
    table = MatchAcceptance(max_class=4, window=256)
    assert table.values(3, 3) == [0.5, 0.25, 0.125]  # Laplace's rule before any sample
    table.record(3, num_drafts=4, num_accepted=2)  # drafts 1, 2 accepted; 3 rejected; 4 unreached
    # depth 1: 1 of 1 -> 2/3; depth 2: 1 of 1 -> 2/3; depth 3: 0 of 1 -> 1/3; depth 4: 1/2.
    assert table.values(3, 4) == pytest.approx([2 / 3, 4 / 9, 4 / 27, 2 / 27])
    assert table.values(2, 2) == [0.5, 0.25]  # another match length: its own counts
    table.record(9, num_drafts=1, num_accepted=1)  # 9 >= max_class: class 4
    assert table.values(4, 1) == pytest.approx([2 / 3])
    assert table.values(0, 1) == [0.5]  # no match: class 0
    table.record(3, num_drafts=2, num_accepted=0)  # only depth 1 was reached
    assert table.values(3, 2) == pytest.approx([2 / 4, 2 / 4 * 2 / 3])  # 1 of 2, 1 of 1


def test_match_acceptance_halves_a_full_cell():
    table = MatchAcceptance(window=4)
    for _ in range(3):
        table.record(1, 1, 1)
    assert table.values(1, 1) == pytest.approx([4 / 5])  # 3 of 3
    table.record(1, 1, 0)  # 3 of 4 reaches the window: 1.5 of 2
    assert table.values(1, 1) == pytest.approx([2.5 / 4])


@pytest.mark.parametrize(("kwargs", "name"), [({"max_class": 0}, "max_class"), ({"window": 1}, "window")])
def test_match_acceptance_bad_arguments_name_the_field(kwargs, name):
    with pytest.raises(ValueError, match=name):
        MatchAcceptance(**kwargs)


def test_drafts_with_match_lengths_are_valued_by_the_match_table():
    # Past the knee each row costs 0.1 step: a draft pays only when its value beats ~0.3.
    alloc = DraftAllocator(knee_rows=4, row_cost=0.1, prior=0.7, learn_step_cost=False)
    for _ in range(20):  # long matches were always copied, 1-token matches never
        alloc.match_acceptance.record(4, 4, 4)
        alloc.match_acceptance.record(1, 4, 0)
    # Seqs 0-3 have the same history (alpha = prior); only the match lengths differ. Seq 3
    # reports none, so it keeps the geometric 0.7 ** j. The 8 drafts of seqs 0 and 2 (21 / 22,
    # then its powers) take the goodput to 11.13 tokens / 1.8 steps = 6.18; seq 3's 0.7 draft
    # raises it (6.23), its 0.49 draft would not; seq 1's drafts (1 / 22) never pay.
    kept = alloc.allocate({0: 4, 1: 4, 2: 4, 3: 4}, num_rows=4, match_lengths={0: 4, 1: 1, 2: 6})
    assert kept == {0: 4, 1: 0, 2: 4, 3: 1}
    # The verification that follows teaches the table of the seqs that had a match length.
    alloc.record(0, 4, 1)  # class 4: depth 1 accepted, depth 2 rejected
    alloc.record(3, 1, 1)  # no match length: alpha only
    assert alloc.match_acceptance.values(4, 2) == pytest.approx([22 / 23, 22 / 23 * 21 / 23])
    assert alloc.alpha(0) == pytest.approx(0.7 + 0.3 * (0.5 - 0.7))
    assert alloc.alpha(3) == pytest.approx(0.7 + 0.3 * (1.0 - 0.7))
    alloc.record(2, 0, 0)  # dropped before verification: nothing to learn, the match is cleared
    alloc.record(2, 4, 4)
    assert alloc.match_acceptance.values(4, 2) == pytest.approx([22 / 23, 22 / 23 * 21 / 23])


def test_a_sequence_that_misses_where_its_match_class_copies_backs_off():
    alloc = DraftAllocator(knee_rows=1, row_cost=0.5, smoothing=0.5, learn_step_cost=False)
    for _ in range(20):
        alloc.match_acceptance.record(4, 2, 2)  # 4-token matches: both drafts always accepted
    p = 21 / 22
    assert alloc.reliability(7) == 1.0
    assert alloc.allocate({7: 2}, num_rows=1, match_lengths={7: 4}) == {7: 2}
    alloc.record(7, 2, 0)  # this sequence missed: expected p + p^2, accepted 0
    expected = p + p * p
    assert alloc.reliability(7) == pytest.approx(2 / (expected + 2))
    # Row cost 0.5 past 1 row: a draft pays while value > 0.5 * goodput. Scaled by the
    # reliability (0.51) the first draft is worth 0.49 < 0.5 * 1: dropped.
    assert alloc.allocate({7: 2}, num_rows=1, match_lengths={7: 4}) == {7: 0}
    # The drop decays the sums by smoothing (0.5), and the sequence is tried again.
    assert alloc.reliability(7) == pytest.approx(2 / (expected / 2 + 2))
    assert alloc.allocate({7: 2}, num_rows=1, match_lengths={7: 4}) == {7: 2}
    # Another sequence with the same match length is not held back.
    assert alloc.reliability(8) == 1.0
    alloc.forget(7)
    assert alloc.reliability(7) == 1.0


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
    assert spec.allocator.learn_step_cost
    cfg = parse_speculative_config({"method": "suffix", "learn_step_cost": False})
    assert not Speculator(cfg, max_model_len=64).allocator.learn_step_cost
    with pytest.raises(ValueError, match="speculative_config.learn_step_cost"):
        parse_speculative_config({"learn_step_cost": 1})
    with pytest.raises(ValueError, match="speculative_config.step_row_cost"):
        parse_speculative_config({"step_row_cost": -0.1})
    with pytest.raises(ValueError, match="speculative_config.step_rows_knee"):
        parse_speculative_config({"step_rows_knee": 0})


def test_step_cost_table_prior_quartile_interpolation_and_extrapolation():
    table = StepCostTable(knee_rows=6, row_cost=0.025, window=8, min_samples=3)
    assert table.cost(40) == pytest.approx(1 + 0.025 * 34)  # the prior until measured
    table.observe(8, 0.031)
    table.observe(8, 0.030)
    assert table.measured == [] and table.cost(8) == pytest.approx(1.05)  # 2 < min_samples
    table.observe(8, 0.100)  # a slow step: the lower quartile ignores it
    assert table.measured == [(8, 0.030)]
    # One count measured: the prior's shape, scaled to it.
    assert table.cost(40) == pytest.approx(0.030 * (1 + 0.025 * 34) / 1.05)
    for t in (0.050, 0.052, 0.051, 0.049):
        table.observe(16, t)
    assert table.measured == [(8, 0.030), (16, 0.050)]  # sorted(...)[4 // 4] = 0.050
    assert table.cost(12) == pytest.approx(0.040)  # linear between the neighbours
    assert table.cost(24) == pytest.approx(0.050 + 0.0025 * 8)  # the last slope carried on
    assert table.cost(4) == pytest.approx(0.030 * 1.0 / 1.05)  # below: the prior's shape
    table.observe(0, 1.0)
    table.observe(3, 0.0)
    assert table.measured == [(8, 0.030), (16, 0.050)]  # ignored


def test_step_cost_table_is_non_decreasing_and_forgets_old_samples():
    table = StepCostTable(window=4, min_samples=1)
    table.observe(4, 0.040)
    table.observe(8, 0.030)  # fewer rows slower than more: pooled, weighted by count
    assert table.measured == [(4, 0.035), (8, 0.035)]
    for _ in range(4):
        table.observe(4, 0.020)  # the 0.040 sample leaves the window of 4
    assert table.measured == [(4, 0.020), (8, 0.030)]
    with pytest.raises(ValueError, match="window"):
        StepCostTable(window=0)
    with pytest.raises(ValueError, match="min_samples"):
        StepCostTable(window=4, min_samples=5)


def test_a_count_not_seen_for_max_age_steps_is_forgotten_and_tried_again():
    alloc = DraftAllocator(knee_rows=64, row_cost=0.025, prior=0.6)
    alloc.step_cost = StepCostTable(64, 0.025, window=4, min_samples=3, min_age=8, max_age=8)
    for _ in range(3):  # 40 rows measured while something else slowed the machine
        alloc.observe_step(8, 0.030)
        alloc.observe_step(40, 0.500)
    proposals = {i: 4 for i in range(8)}
    assert alloc.allocate(proposals, num_rows=8) == dict.fromkeys(range(8), 0)
    # Only plain steps follow. The 40-row count was last seen at step 6 and the check runs every
    # window (4) steps: at step 12 it is 6 steps old and stays; at step 16, 10 >= 8, forgotten.
    for _ in range(6):
        alloc.observe_step(8, 0.030)
    assert alloc.step_cost.measured == [(8, 0.030), (40, 0.500)]
    for _ in range(4):
        alloc.observe_step(8, 0.030)
    assert alloc.step_cost.measured == [(8, 0.030)]
    # Estimated from 8 rows with the prior's shape again (flat to 64 rows): every draft kept.
    assert sum(alloc.allocate(proposals, num_rows=8).values()) == 32
    with pytest.raises(ValueError, match="max_age"):
        StepCostTable(window=4, max_age=3)
    with pytest.raises(ValueError, match="min_age"):
        StepCostTable(window=4, min_age=2, max_age=8)
    with pytest.raises(ValueError, match="min_age"):
        StepCostTable(window=4, min_age=16, max_age=8)


def test_the_age_limit_doubles_each_time_a_count_is_forgotten():
    table = StepCostTable(64, 0.025, window=4, min_samples=3, min_age=4, max_age=16)
    forgotten_at = []
    for _ in range(4):  # the 40-row count measured slow, then only 8-row steps until it goes
        for _ in range(3):
            table.observe(40, 0.500)
        assert (40, 0.500) in table.measured
        since = 0
        while any(rows == 40 for rows, _ in table.measured):
            table.observe(8, 0.030)
            since += 1
        forgotten_at.append(since)
    # Checked every window (4) steps, one step after the count's last sample each time: forgotten
    # at the first check where its age reaches the limit of 4, 8, 16 (max_age), 16.
    assert forgotten_at == [5, 9, 17, 17]
    assert [table.age_limit(40), table.age_limit(8)] == [16, 4]
    for _ in range(4):  # the count fills its window: in regular use, the backoff starts over
        table.observe(40, 0.050)
    assert table.age_limit(40) == 4


def test_measured_step_costs_replace_the_prior():
    # The prior says every row is free (knee 64): all 8 x 4 drafts of alpha 0.6 are kept.
    alloc = DraftAllocator(knee_rows=64, row_cost=0.025, prior=0.6)
    proposals = {i: 4 for i in range(8)}
    assert sum(alloc.allocate(proposals, num_rows=8).values()) == 32
    # Measured: 8 rows 30 ms, 40 rows 120 ms (each row 2.8 ms, ~9 % of a plain step).
    fixed = DraftAllocator(knee_rows=64, row_cost=0.025, prior=0.6, learn_step_cost=False)
    for _ in range(3):
        for a in (alloc, fixed):
            a.observe_step(8, 0.030)
            a.observe_step(40, 0.120)
    assert sum(fixed.allocate(proposals, num_rows=8).values()) == 32
    # Goodput (8 + 0.6 n) / (30 + 2.8125 n) ms for n first drafts: falls from the first one
    # (0.6 / 2.8125 < 8 / 30), so none is kept.
    assert alloc.allocate(proposals, num_rows=8) == dict.fromkeys(range(8), 0)
    mixed = DraftAllocator(knee_rows=64, row_cost=0.025, smoothing=1.0)
    for seq_id in range(8):
        mixed.record(seq_id, 4, 4 if seq_id < 4 else 1)  # alpha 1.0 for 0-3, 0.5 for 4-7
    for _ in range(3):
        mixed.observe_step(8, 0.030)
        mixed.observe_step(40, 0.120)
    # A certain draft pays for its row (24 / (30 + 16 * 2.8125) = 0.32 > 8 / 30); a 0.5 draft
    # after them does not (24.5 / 77.8 < 0.32).
    assert mixed.allocate(proposals, num_rows=8) == {0: 4, 1: 4, 2: 4, 3: 4, 4: 0, 5: 0, 6: 0, 7: 0}


def test_the_engine_reports_every_decode_and_verification_step(tiny_loaded):
    from collections import Counter

    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    llm = LLM(loaded=tiny_loaded, max_model_len=256, kv_cache_memory=1 << 22,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    core = llm.engine.engine_core
    table = core.speculator.allocator.step_cost = StepCostTable(window=10_000, min_age=10_000, max_age=10_000)
    decode_rows: Counter[int] = Counter()
    run_model = core.executor.execute_model

    def counting(sched):
        works = [w for _, w in sched.scheduled]
        if works and all(len(w.token_ids) == 1 + w.num_spec_tokens and w.do_sample for w in works):
            decode_rows[sum(len(w.token_ids) for w in works)] += 1
        return run_model(sched)

    core.executor.execute_model = counting
    prompts = [[10, 11, 12, 13, 14] * 6, list(range(20, 60))]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    counted = Counter({rows: len(s) for rows, s in table._samples.items()})
    assert counted == decode_rows and sum(counted.values()) > 0
    assert max(counted) <= 2 * 5  # the two prompts' prefills (30 and 40 tokens) are not steps here
    # The n-gram proposer reports match lengths: every verification reached depth 1 of its class.
    match_table = core.speculator.allocator.match_acceptance
    reached = sum(cells[0][0] for cells in match_table._counts if cells)
    assert reached == llm.engine.stats.spec_num_drafts > 0
