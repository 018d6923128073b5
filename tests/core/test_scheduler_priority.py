"""Scheduler, priority policy: (priority, arrival) order, priority preemption of the least urgent
running group (recompute and swap), no preemption on ties, block ids and ref counts."""

import pytest

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.engine.llm_engine import check_priority
from pagedllm.sequence import SequenceStatus
from tests.core.test_scheduler import finish_step, group


def make(mode="recompute", num_blocks=8, max_num_seqs=8, num_swap_blocks=0):
    bm = BlockManager(num_blocks, 4, num_swap_blocks=num_swap_blocks, watermark=0)
    cfg = SchedulerConfig(max_num_seqs, 64, 256, policy="priority", preemption_mode=mode)
    return Scheduler(cfg, bm), bm


def pgroup(rid, n_prompt, arrival, priority):
    g = group(rid, n_prompt, arrival)
    g.priority = priority
    return g


def run_two(sch, pa, pb):
    """Admit a (12-token prompt, priority ``pa``) and b (``pb``) and run their prefill; they
    then hold blocks 0-2 and 3-5 of the 8."""
    a, b = pgroup("a", 12, 0, pa), pgroup("b", 12, 1, pb)
    sch.add_seq_group(a)
    sch.add_seq_group(b)
    out = sch.schedule()
    assert [(r, w.block_table) for r, w in out.scheduled] == [("a", [0, 1, 2]), ("b", [3, 4, 5])]
    finish_step(out, [a, b])
    return a, b


def test_waiting_order_is_priority_then_arrival():
    sch, bm = make(max_num_seqs=2)
    gs = [pgroup(r, 4, i, p) for i, (r, p) in enumerate([("a", 2), ("b", 0), ("c", 1), ("d", 0)])]
    for g in gs:
        sch.add_seq_group(g)
    assert [g.request_id for g in sch.waiting] == ["b", "d", "c", "a"]
    out = sch.schedule()
    assert [(r, w.block_table) for r, w in out.scheduled] == [("b", [0]), ("d", [1])]
    assert not out.preempted  # a, c are less urgent than every running group
    bm.check_invariants()


def test_urgent_arrival_preempts_least_urgent_by_recompute():
    sch, bm = make()
    a, b = run_two(sch, 1, 2)
    c = pgroup("c", 12, 2, 0)
    sch.add_seq_group(c)
    out = sch.schedule()
    # b (priority 2) is the victim, whole; a keeps decoding; c is admitted in the same step.
    assert out.preempted == ["b"] and not out.blocks_to_swap_out
    assert [(r, w.start_pos, len(w.token_ids), w.block_table) for r, w in out.scheduled] == [
        ("a", 12, 1, [0, 1, 2, 6]),
        ("c", 0, 12, [7, 5, 4]),
    ]
    assert [g.request_id for g in sch.running] == ["c", "a"]
    assert [g.request_id for g in sch.waiting] == ["b"]
    assert b.seqs[0].status == SequenceStatus.WAITING and b.seqs[0].num_computed_tokens == 0
    assert b.seqs[0].output_token_ids == [7]  # its generated token survives the recompute
    assert bm.ref_counts() == [1, 1, 1, 0, 1, 1, 1, 1]
    bm.check_invariants()


def test_urgent_arrival_swaps_out_a_group():
    sch, bm = make(mode="swap", num_swap_blocks=8)
    a, b = run_two(sch, 5, 5)
    c = pgroup("c", 12, 2, 1)
    sch.add_seq_group(c)
    out = sch.schedule()
    # Equal priorities: the victim is the later arrival (b); its 3 blocks move to host memory.
    assert out.preempted == ["b"]
    assert [src for src, _ in out.blocks_to_swap_out] == [3, 4, 5]
    assert [r for r, _ in out.scheduled] == ["a", "c"]
    assert [g.request_id for g in sch.swapped] == ["b"]
    assert b.seqs[0].status == SequenceStatus.SWAPPED
    bm.check_invariants()
    # c and a finish: b comes back from swap before anything less urgent.
    for g in (a, c):
        for s in g.seqs:
            s.status = SequenceStatus.FINISHED_STOPPED
    sch.free_finished()
    late = pgroup("late", 4, 3, 9)
    sch.add_seq_group(late)
    out = sch.schedule()
    assert [dst for _, dst in out.blocks_to_swap_in] and [r for r, _ in out.scheduled][0] == "b"
    assert [g.request_id for g in sch.running] == ["b", "late"]
    bm.check_invariants()


def test_tie_or_less_urgent_arrival_does_not_preempt():
    sch, bm = make()
    run_two(sch, 1, 1)
    sch.add_seq_group(pgroup("c", 12, 2, 1))  # same priority, later: waits (FCFS among ties)
    out = sch.schedule()
    assert not out.preempted and [r for r, _ in out.scheduled] == ["a", "b"]
    assert [g.request_id for g in sch.waiting] == ["c"]
    bm.check_invariants()


def test_priority_preemption_for_max_num_seqs():
    sch, bm = make(max_num_seqs=2)
    a, b = pgroup("a", 4, 0, 0), pgroup("b", 4, 1, 3)
    sch.add_seq_group(a)
    sch.add_seq_group(b)
    finish_step(sch.schedule(), [a, b])
    sch.add_seq_group(pgroup("c", 4, 2, 1))  # blocks are free, the seq limit is not
    out = sch.schedule()
    assert out.preempted == ["b"]
    assert [r for r, _ in out.scheduled] == ["a", "c"]
    bm.check_invariants()


def test_priority_must_be_zero_under_fcfs():
    check_priority(0, "fcfs")
    check_priority(-3, "priority")
    with pytest.raises(ValueError, match=r"^priority must be 0 under scheduling_policy 'fcfs'"):
        check_priority(1, "fcfs")
    with pytest.raises(ValueError, match=r"^priority must be an integer"):
        check_priority(1.5, "priority")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(1, 1, 1, policy="lifo")
