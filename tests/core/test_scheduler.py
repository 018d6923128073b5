"""Scheduler: FCFS admission, continuous batching, limits and preemption by recompute."""

import pytest

from pagedllm.core.block_manager import FREED_BLOCK, BlockManager
from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.outputs import RequestMetrics
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus

_ids = iter(range(10**6))


def group(rid: str, n_prompt: int, arrival: int) -> SequenceGroup:
    s = Sequence(next(_ids), list(range(1, n_prompt + 1)), seed=0)
    return SequenceGroup(
        rid, [s], SamplingParams(max_tokens=100), None, arrival, RequestMetrics(0.0), max_tokens=100
    )


def make(num_blocks=8, block_size=4, max_num_seqs=8, max_tokens=64, chunked=False, window=None,
         caching=True):
    bm = BlockManager(num_blocks, block_size, watermark=0, enable_prefix_caching=caching,
                      sliding_window=window)
    cfg = SchedulerConfig(max_num_seqs, max_tokens, 256, enable_chunked_prefill=chunked)
    return Scheduler(cfg, bm), bm


def finish_step(sched_out, groups):
    """What the engine does after the forward pass: advance computed tokens, append a token."""
    by_id = {s.seq_id: s for g in groups for s in g.seqs}
    for _, w in sched_out.scheduled:
        s = by_id[w.seq_id]
        s.num_computed_tokens += len(w.token_ids)
        if w.do_sample:
            s.append_token(7, 0.0)


def test_fcfs_admission_and_block_tables():
    sch, bm = make()
    a, b = group("a", 5, 0), group("b", 3, 1)
    sch.add_seq_group(a)
    sch.add_seq_group(b)
    out = sch.schedule()
    assert [
        (r, w.start_pos, len(w.token_ids), w.block_table, w.do_sample) for r, w in out.scheduled
    ] == [
        ("a", 0, 5, [0, 1], True),
        ("b", 0, 3, [2], True),
    ]
    assert out.num_batched_tokens == 8
    assert [g.request_id for g in sch.running] == ["a", "b"] and not sch.waiting
    finish_step(out, [a, b])
    # Decode: one token each; b (4 tokens in block 2) fills it, a has room in block 1.
    out = sch.schedule()
    assert [(r, w.token_ids, w.start_pos, w.block_table) for r, w in out.scheduled] == [
        ("a", [7], 5, [0, 1]),
        ("b", [7], 3, [2]),
    ]
    finish_step(out, [a, b])
    out = sch.schedule()  # b's 5th token needs a new block: 3
    assert dict((r, w.block_table) for r, w in out.scheduled) == {"a": [0, 1], "b": [2, 3]}
    bm.check_invariants()


def test_new_requests_join_between_decode_steps():
    sch, _ = make()
    a = group("a", 4, 0)
    sch.add_seq_group(a)
    finish_step(sch.schedule(), [a])
    b = group("b", 6, 1)
    sch.add_seq_group(b)
    out = sch.schedule()
    assert [(r, len(w.token_ids)) for r, w in out.scheduled] == [("a", 1), ("b", 6)]


def test_max_num_seqs_and_token_budget():
    sch, _ = make(max_num_seqs=2, max_tokens=10)
    gs = [group(str(i), 4, i) for i in range(4)]
    for g in gs:
        sch.add_seq_group(g)
    out = sch.schedule()
    assert [r for r, _ in out.scheduled] == ["0", "1"]  # max_num_seqs
    sch2, _ = make(max_num_seqs=8, max_tokens=10)
    for g in [group("x", 6, 0), group("y", 6, 1)]:
        sch2.add_seq_group(g)
    assert [r for r, _ in sch2.schedule().scheduled] == ["x"]  # 12 tokens > budget 10
    assert [g.request_id for g in sch2.waiting] == ["y"]


def test_admission_waits_for_blocks():
    sch, _ = make(num_blocks=3)
    a, b = group("a", 8, 0), group("b", 8, 1)  # 2 blocks each
    sch.add_seq_group(a)
    sch.add_seq_group(b)
    out = sch.schedule()
    assert [r for r, _ in out.scheduled] == ["a"]
    assert [g.request_id for g in sch.waiting] == ["b"]


def test_preempts_newest_by_recompute_never_the_oldest():
    sch, bm = make(num_blocks=4, block_size=4)
    a, b = group("a", 8, 0), group("b", 8, 1)  # 2 blocks each: pool full
    sch.add_seq_group(a)
    sch.add_seq_group(b)
    out = sch.schedule()
    assert bm.num_free_blocks == 0
    finish_step(out, [a, b])  # both now have 9 tokens, need a 3rd block
    out = sch.schedule()
    assert out.preempted == ["b"]
    assert [(r, w.block_table) for r, w in out.scheduled] == [("a", [0, 1, 3])]
    # b's blocks were freed tail first (3 then 2), then a took the front of the free list (3).
    assert bm.allocator.free_block_ids() == [2]
    bs = b.seqs[0]
    assert bs.status == SequenceStatus.WAITING and bs.num_computed_tokens == 0
    assert bs.token_ids[-1] == 7 and bs.num_tokens == 9  # generated token kept
    assert list(sch.waiting) == [b] and b.metrics.num_preemptions == 1
    assert sch.num_preemptions == 1
    bm.check_invariants()
    finish_step(out, [a, b])
    # While a still runs, b cannot come back (needs 3 blocks, 1 free).
    out = sch.schedule()
    assert [r for r, _ in out.scheduled] == ["a"]
    # a finishes: b is readmitted and recomputes prompt + generated token in one prefill.
    for s in a.seqs:
        s.status = SequenceStatus.FINISHED_STOPPED
    sch.free_finished()
    out = sch.schedule()
    assert [(r, w.start_pos, len(w.token_ids)) for r, w in out.scheduled] == [("b", 0, 9)]


def test_preemption_frees_only_what_is_needed():
    sch, bm = make(num_blocks=6, block_size=4)
    gs = [group(n, 8, i) for i, n in enumerate("abc")]
    for g in gs:
        sch.add_seq_group(g)
    finish_step(sch.schedule(), gs)  # pool full, each sequence has 9 tokens in 2 blocks
    out = sch.schedule()
    # a needs a 3rd block: c (newest) is preempted, freeing 5 then 4; a takes 5, b takes 4.
    assert out.preempted == ["c"]
    assert [(r, w.block_table) for r, w in out.scheduled] == [("a", [0, 1, 5]), ("b", [2, 3, 4])]
    assert list(sch.waiting) == [gs[2]] and [g.request_id for g in sch.running] == ["a", "b"]
    bm.check_invariants()


def test_two_victims_requeue_in_fcfs_order():
    sch, bm = make(num_blocks=4, block_size=4)
    gs = [group(n, 4, i) for i, n in enumerate("abcd")]  # 1 block each: pool full
    for g in gs:
        sch.add_seq_group(g)
    finish_step(sch.schedule(), gs)  # each now has 5 tokens: position 4 needs a 2nd block
    out = sch.schedule()
    # a preempts d; b preempts c; the waiting queue reads c, d (oldest first).
    assert out.preempted == ["d", "c"]
    assert [g.request_id for g in sch.waiting] == ["c", "d"]
    assert [r for r, _ in out.scheduled] == ["a", "b"]
    bm.check_invariants()


def test_abort_frees_blocks_from_any_queue():
    sch, bm = make()
    a, b = group("a", 8, 0), group("b", 4, 1)
    sch.add_seq_group(a)
    sch.schedule()
    sch.add_seq_group(b)
    assert sch.abort("a") is a and a.seqs[0].status == SequenceStatus.FINISHED_ABORTED
    assert sch.abort("b") is b
    assert sch.abort("zzz") is None
    assert bm.num_free_blocks == 8 and not sch.has_unfinished()
    bm.check_invariants()


def test_chunked_prefill_splits_prompt_over_steps():
    sch, bm = make(max_tokens=4, chunked=True)
    a = group("a", 10, 0)
    sch.add_seq_group(a)
    spans = []
    for _ in range(3):
        out = sch.schedule()
        spans += [(w.start_pos, len(w.token_ids), w.do_sample) for _, w in out.scheduled]
        finish_step(out, [a])
    assert spans == [(0, 4, False), (4, 4, False), (8, 2, True)]
    assert bm.get_block_table(a.seqs[0]) == [0, 1, 2]


def test_prefill_first_runs_an_admission_in_a_step_of_its_own():
    """``prefill_first``: a new request that fits is prefilled alone (the running decode waits
    one step); one that does not fit never stalls the decodes."""
    bm = BlockManager(8, 4, watermark=0)
    sch = Scheduler(SchedulerConfig(2, 64, 256, prefill_first=True), bm)
    a = group("a", 4, 0)
    sch.add_seq_group(a)
    out = sch.schedule()
    assert [(r, len(w.token_ids)) for r, w in out.scheduled] == [("a", 4)]
    finish_step(out, [a])
    b = group("b", 6, 1)
    sch.add_seq_group(b)
    out = sch.schedule()  # b's prefill alone: a's decode (and its next block) wait a step
    assert [(r, w.start_pos, len(w.token_ids), w.block_table) for r, w in out.scheduled] == [
        ("b", 0, 6, [1, 2])
    ]
    finish_step(out, [a, b])
    c = group("c", 3, 2)  # a third request: max_num_seqs (2) is full, so decodes go on
    sch.add_seq_group(c)
    out = sch.schedule()
    assert [(r, w.token_ids, w.start_pos, w.block_table) for r, w in out.scheduled] == [
        ("a", [7], 4, [0, 3]),
        ("b", [7], 6, [1, 2]),
    ]
    assert list(sch.waiting) == [c]
    bm.check_invariants()


def test_prefill_first_needs_fcfs():
    with pytest.raises(ValueError, match="prefill_first"):
        SchedulerConfig(2, 64, 256, policy="priority", prefill_first=True)


def test_samples_sharing_a_partial_block_fit_when_copies_minus_one_are_free():
    """n = 3 samples of a 6-token prompt share its half-full second block. Their first decode
    needs two copies (the last writer keeps the block): with exactly 2 blocks free, all three
    run; counting a copy per writer finished the request by length instead."""
    sch, bm = make(num_blocks=4)
    g = group("a", 6, 0)
    sch.add_seq_group(g)
    finish_step(sch.schedule(), [g])  # prefill: blocks 0, 1
    lead = g.seqs[0]
    for i in (1, 2):
        child = lead.fork(next(_ids), seed=i)
        child.token_ids[-1] = 7 + i  # each sample drew its own first token
        bm.fork(lead, child)
        g.seqs.append(child)
    assert bm.num_free_blocks == 2
    out = sch.schedule()
    assert not out.length_capped and not out.preempted
    assert [w.block_table for _, w in out.scheduled] == [[0, 2], [0, 3], [0, 1]]
    assert bm.num_free_blocks == 0 and bm.allocator.ref_counts == [3, 1, 1, 1]
    bm.check_invariants()


def _readmitted_pair(prompt_len: int, outputs: int) -> SequenceGroup:
    """An n = 2 group as a recompute preemption leaves it: two samples of one prompt, each
    with ``outputs`` tokens of its own, nothing computed, waiting."""
    lead = Sequence(next(_ids), list(range(1, prompt_len + 1)), seed=0)
    other = lead.fork(next(_ids), seed=1)
    for i in range(outputs):
        lead.append_token(50 + i, 0.0)
        other.append_token(60 + i, 0.0)
    return SequenceGroup(
        "g", [lead, other], SamplingParams(n=2, max_tokens=100), None, 0, RequestMetrics(0.0),
        max_tokens=100,
    )


def test_chunked_readmission_followers_wait_to_share_the_prompt_blocks():
    """Chunked prefill with a budget of 8: a readmitted n = 2 group (12-token prompt, 5 output
    tokens each) computes the lead's 17 tokens in chunks; the other sample waits, unscheduled
    and without blocks, until the lead has written the 3 prompt blocks, then shares them (ref
    count 2) and computes only its own 5 tokens: 5 + 2 blocks, not 5 + 5 (it used to
    recompute the prompt into blocks of its own, and the group was finished by length)."""
    sch, bm = make(num_blocks=8, block_size=4, max_tokens=8, chunked=True)
    g = _readmitted_pair(12, 5)
    lead, other = g.seqs
    sch.add_seq_group(g)
    assert bm.group_shared_blocks(g.seqs) == 3 and bm.can_allocate(g.seqs, watermark=False)
    steps = []
    for _ in range(4):
        out = sch.schedule()
        steps.append([(w.seq_id, w.start_pos, len(w.token_ids), list(w.block_table))
                      for _, w in out.scheduled])
        for _, w in out.scheduled:
            s = lead if w.seq_id == lead.seq_id else other
            s.num_computed_tokens += len(w.token_ids)
            bm.mark_computed(s)
        bm.check_invariants()
    assert steps == [
        [(lead.seq_id, 0, 8, [0, 1])],  # the other sample: no table yet
        [(lead.seq_id, 8, 8, [0, 1, 2, 3])],  # prompt blocks 0-2 written by this step's end
        [(lead.seq_id, 16, 1, [0, 1, 2, 3, 4]), (other.seq_id, 12, 5, [0, 1, 2, 5, 6])],
        [],
    ]
    assert bm.allocator.ref_counts[:7] == [2, 2, 2, 1, 1, 1, 1] and bm.num_free_blocks == 1


def test_chunked_readmission_does_not_share_blocks_a_window_let_go():
    """With a sliding window the lead frees the blocks behind it while it computes on; a
    waiting sample whose window still reads them takes its own prefix instead."""
    bm = BlockManager(16, 4, watermark=0, sliding_window=4)
    lead = Sequence(next(_ids), list(range(1, 21)), seed=0)
    bm.allocate_prefix(lead)
    bm.allocate_slots(lead, 16)
    lead.num_computed_tokens = 16
    bm.mark_computed(lead)  # blocks 0-2 lie wholly behind position 16's window: freed
    assert bm.get_block_table(lead)[:4] == [-1, -1, -1, 3]
    assert not bm.can_share_prefix(lead, 3)  # position 12's window reads block 2
    assert bm.can_share_prefix(lead, 4)


def _run_bounded(sch, bm, g, max_outputs, max_steps=20):
    """Step ``g`` (alone) until its sequences have ``max_outputs`` tokens each; returns each
    step's ``(sequence index, start, tokens, block table)``, each step's pool once scheduled
    (reference counts, free blocks) and the requests capped. Bounded: a stall fails the
    caller's asserts instead of hanging."""
    first = g.seqs[0].seq_id
    by_id = {s.seq_id: s for s in g.seqs}
    steps, pools, capped = [], [], []
    for _ in range(max_steps):
        out = sch.schedule()
        capped += out.length_capped
        steps.append([(w.seq_id - first, w.start_pos, len(w.token_ids), list(w.block_table))
                      for _, w in out.scheduled])
        pools.append((bm.ref_counts(), bm.num_free_blocks))
        sch.on_step_done(out)
        for _, w in out.scheduled:
            s = by_id[w.seq_id]
            if w.do_sample:
                s.append_token(90, 0.0)
                if s.num_output_tokens == max_outputs:
                    s.status = SequenceStatus.FINISHED_LENGTH
                    sch.free_seq(s)
        sch.free_finished()
        bm.check_invariants()
        if not sch.has_unfinished():
            break
    return steps, pools, capped

def test_chunks_of_a_windowed_readmission_are_cut_to_fit_instead_of_capped():
    """Window 4, blocks of 4, 4 blocks, budget 6, no prefix caching: a readmitted n = 2 group
    (8-token prompt, 3 output tokens each, max_tokens 6). The lead's window frees the prompt
    blocks before the other sample can share them, so that sample recomputes its prefix in
    chunks of its own. In the fourth step the lead's decode needs a block and the other's
    5-token chunk another, with 1 free and no other request to preempt: the chunk is cut to the
    3 tokens that fit in the block it holds. Judged on the 5-token chunk, the group was finished
    by length at 5 and 3 tokens."""
    sch, bm = make(num_blocks=4, block_size=4, max_tokens=6, chunked=True, window=4, caching=False)
    F = FREED_BLOCK
    g = _readmitted_pair(8, 3)
    sch.add_seq_group(g)
    steps, pools, capped = _run_bounded(sch, bm, g, 6)
    assert steps == [
        [(0, 0, 6, [0, 1])],  # the other sample waits to share the 2 prompt blocks
        [(0, 6, 5, [0, 1, 2])],  # the lead's window then frees them: the other cannot share
        [(0, 11, 1, [F, F, 2]), (1, 0, 5, [3, 1])],  # it recomputes its prefix itself
        [(0, 12, 1, [F, F, 2, 0]), (1, 5, 3, [3, 1])],  # 1 block free: 3 tokens, not 5
        [(1, 8, 3, [F, 1, 3])],
        [(1, 11, 1, [F, F, 3])],
        [(1, 12, 1, [F, F, 3, 0])],
    ]
    assert pools[3] == ([1, 1, 1, 1], 0)  # the whole pool, each block held once
    assert not capped and [s.num_output_tokens for s in g.seqs] == [6, 6]
    assert not sch.has_unfinished() and bm.num_free_blocks == 4 and not bm.block_tables


def test_a_windowed_readmission_that_outgrew_the_pool_is_admitted_on_its_first_chunk():
    """Window 4, blocks of 4, 4 blocks, budget 6, no prefix caching: a readmitted n = 2 group
    (8-token prompt, 6 output tokens each) whose whole sequences need 4 + 2 blocks. With the
    pool to itself it is admitted on the lead's first chunk (2 blocks), the other sample
    waiting without blocks; the window then frees the blocks behind each chunk, so the group
    never holds more than the pool. Judged on whole sequences, it was finished by length at
    6 and 6 tokens."""
    sch, bm = make(num_blocks=4, block_size=4, max_tokens=6, chunked=True, window=4, caching=False)
    F = FREED_BLOCK
    g = _readmitted_pair(8, 6)
    sch.add_seq_group(g)
    assert not bm.can_allocate(g.seqs, watermark=False)  # 4 + 2 blocks of 4
    steps, pools, capped = _run_bounded(sch, bm, g, 8)
    assert steps == [
        [(0, 0, 6, [0, 1])],  # the other sample waits to share the 2 prompt blocks
        [(0, 6, 6, [0, 1, 2])],
        [(0, 12, 2, [F, F, 2, 3]), (1, 0, 4, [1])],  # the window freed them: its own prefix
        [(0, 14, 1, [F, F, 2, 3]), (1, 4, 4, [1, 0])],
        [(1, 8, 6, [F, 0, 2, 1])],
        [(1, 14, 1, [F, F, 2, 1])],
    ]
    assert pools[0] == ([1, 1, 0, 0], 2)  # the other sample holds nothing yet
    assert pools[3] == ([1, 1, 1, 1], 0)  # the whole pool, each block held once
    assert not capped and [s.num_output_tokens for s in g.seqs] == [8, 8]
    assert not sch.has_unfinished() and bm.num_free_blocks == 4 and not bm.block_tables


def test_a_long_windowed_sequence_readmitted_alone_is_recomputed_in_chunks_that_fit():
    """Window 4, blocks of 4, 4 blocks, budget 6: one sequence of 8 prompt and 12 output tokens
    preempted by recompute (5 blocks whole). While another group runs it waits for its whole
    sequence (admitted on a chunk beside it, it would be preempted again); alone in the pool it
    is admitted on its first chunk and the window frees the blocks behind each chunk, so it
    never holds more than 3. Judged on its whole sequence, it was finished by length at 12
    output tokens."""
    sch, bm = make(num_blocks=4, block_size=4, max_tokens=6, chunked=True, window=4, caching=False)
    F = FREED_BLOCK
    s = Sequence(next(_ids), list(range(1, 9)), seed=0)
    for i in range(12):
        s.append_token(50 + i, 0.0)
    g = SequenceGroup("g", [s], SamplingParams(max_tokens=100), None, 1, RequestMetrics(0.0),
                      max_tokens=100)
    runner = group("r", 8, 0)
    sch.add_seq_group(runner)
    sch.on_step_done(sch.schedule())  # the older request takes 2 blocks
    sch.add_seq_group(g)
    out = sch.schedule()  # the runner's last 2 prompt tokens; 2 blocks free of the 5 it needs
    assert [w.seq_id for _, w in out.scheduled] == [runner.seqs[0].seq_id]
    assert not out.length_capped and sch.waiting[0] is g
    sch.abort("r")
    assert bm.num_free_blocks == 4 and sch.waiting[0] is g
    steps, pools, capped = _run_bounded(sch, bm, g, 14)
    assert steps == [
        [(0, 0, 6, [2, 3])],  # (the runner's blocks 0, 1 went back tail first)
        [(0, 6, 6, [2, 3, 1])],
        [(0, 12, 6, [F, F, 1, 0, 3])],  # blocks 2, 3 freed behind the window, 3 reused
        [(0, 18, 2, [F, F, F, 0, 3])],
        [(0, 20, 1, [F, F, F, F, 3, 2])],
    ]
    assert max(sum(counts) for counts, _ in pools) == 3
    assert not capped and s.num_output_tokens == 14
    assert not sch.has_unfinished() and bm.num_free_blocks == 4 and not bm.block_tables
