"""A fully windowed model (Mistral) frees the blocks behind its window while requests run:
blocks held per sequence stay within ceil(window / block_size) + 1 with the exact expected counts,
and outputs equal transformers and a run without freeing, under prefix caching, chunked prefill,
parallel sampling, beam search and preemption by swap and by recompute."""

from __future__ import annotations

import pytest
import torch

from pagedllm.core.block_manager import FREED_BLOCK
from pagedllm.core.kv_manager import uniform_sliding_window
from pagedllm.engine.kv_snapshot import kv_snapshot
from pagedllm.sampling_params import SamplingParams
from tests.engine.test_kv_snapshot import check_snapshot
from tests.model.arch_utils import (
    Reference,
    build_tiny_hf_model,
    compare_to_reference,
    greedy_reference,
)

WINDOW, BLOCK = 32, 16
PROMPT_LEN, NEW = 20, 300


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-mistral-w32")
    hf = build_tiny_hf_model("mistral", folder, sliding_window=WINDOW, max_position_embeddings=512)
    g = torch.Generator().manual_seed(3)
    vocab = hf.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (PROMPT_LEN, 70, 45)]
    return hf, folder, prompts


def make_llm(folder, num_blocks: int = 24, **kw):
    """A small pool (``num_blocks``): a 320-token sequence without freeing needs 20 blocks."""
    from pagedllm.entrypoints.llm import LLM

    return LLM(
        str(folder), dtype="float32", block_size=BLOCK, max_model_len=512, check_invariants=True,
        num_gpu_blocks_override=num_blocks, **kw,
    )  # fmt: skip


@torch.no_grad()
def teacher_forced_reference(hf, prompt: list[int], tokens: list[int]) -> Reference:
    """transformers' greedy choice at every step of ``prompt + tokens`` in one forward pass
    (each step sees the tokens pagedllm chose before it; the same rule as greedy_reference)."""
    logits = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :].float()
    top = torch.topk(logits, 2, dim=-1).values
    lp = torch.log_softmax(logits, -1)
    best = logits.argmax(-1).tolist()
    return Reference(
        best, (top[:, 0] - top[:, 1]).tolist(), [float(lp[i, t]) for i, t in enumerate(best)]
    )


def spy_blocks_held(llm) -> list[int]:
    """Record, at every slot allocation, the blocks its sequence holds (the step's peak)."""
    bm = llm.engine.block_manager
    held: list[int] = []
    allocate = bm.allocate_slots

    def allocate_and_count(seq, n):
        copies = allocate(seq, n)
        held.append(bm.num_live_blocks(seq))
        return copies

    bm.allocate_slots = allocate_and_count
    return held


def expected_held(prompt_len: int, steps: int) -> list[int]:
    """Blocks a sequence needs while computing positions c .. c + n - 1: from the block of
    c - window + 1 (the first key of the first query) to the block of c + n - 1."""
    out = [-(-prompt_len // BLOCK)]  # the prefill step
    for p in range(prompt_len, prompt_len + steps - 1):  # one decode step per position
        out.append(p // BLOCK + 1 - max(0, p - WINDOW + 1) // BLOCK)
    return out


def test_blocks_held_bounded_by_window_and_tokens_equal_transformers(mistral):
    hf, folder, prompts = mistral
    llm = make_llm(folder, num_blocks=8)  # without freeing the sequence needs 20 blocks
    assert llm.engine.block_manager.sliding_window == WINDOW
    held = spy_blocks_held(llm)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    c = llm.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0]
    assert held == expected_held(PROMPT_LEN, NEW)
    assert max(held) == -(-WINDOW // BLOCK) + 1 == 3
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    ref = teacher_forced_reference(hf, prompts[0], c.token_ids)
    lps = [pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids, strict=True)]
    assert compare_to_reference(c.token_ids, lps, ref) >= 0.75 * NEW


def test_shared_prefix_longer_than_window_equals_cold_run(mistral):
    _, folder, prompts = mistral
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = prompts[1]  # 70 tokens, > 2 windows
    follow = base[:66] + [5, 6, 7, 8, 9, 10]
    warm = make_llm(folder, enable_prefix_caching=True)  # freed blocks stay cached
    first = warm.generate([base], params, use_tqdm=False)[0].outputs[0].token_ids
    second = warm.generate([follow], params, use_tqdm=False)[0].outputs[0].token_ids
    pc = warm.engine.block_manager.prefix_cache
    assert pc is not None and pc.hits == 4  # 4 full blocks of the 66 shared tokens
    cold = make_llm(folder, enable_prefix_caching=False)
    assert cold.generate([base], params, use_tqdm=False)[0].outputs[0].token_ids == first
    assert cold.generate([follow], params, use_tqdm=False)[0].outputs[0].token_ids == second


# case -> (sampling params, pool blocks small enough that the three prompts preempt)
CASES = {
    "greedy": (SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), 8),
    "n3": (SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=60, ignore_eos=True), 10),
    "beam": (SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0, max_tokens=40,
                            ignore_eos=True), 14),
}  # fmt: skip


def run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def alone(mistral):
    """Each case, each prompt alone, with freeing turned off (every block kept)."""
    _, folder, prompts = mistral
    llm = make_llm(folder, num_blocks=64)
    llm.engine.block_manager.sliding_window = None  # keep every block: the plain paged path
    return {k: [run(llm, [p], sp)[0] for p in prompts] for k, (sp, _) in CASES.items()}


@pytest.mark.slow  # 6 engine runs of 3 requests on a tiny model
@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("case", list(CASES))
def test_outputs_identical_under_preemption_with_freeing(mistral, alone, mode, case):
    _, folder, prompts = mistral
    params, num_blocks = CASES[case]
    llm = make_llm(folder, num_blocks, preemption_mode=mode, enable_prefix_caching=False)
    assert run(llm, prompts, params) == alone[case]
    sched = llm.engine.scheduler
    assert sched.preemptions_by_mode[mode] > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_chunked_prefill_and_prompt_logprobs_equal_transformers(mistral):
    hf, folder, prompts = mistral
    llm = make_llm(folder, enable_chunked_prefill=True, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    out = llm.generate([prompts[1]], params, use_tqdm=False)[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompts[1]])).logits[0].float()
    want = torch.log_softmax(logits, -1)
    for i, pos in enumerate(out.prompt_logprobs[1:], start=1):
        tok = prompts[1][i]
        assert abs(pos[tok].logprob - float(want[i - 1, tok])) < 1e-4, i
    ref = greedy_reference(hf, prompts[1], 8)
    assert out.outputs[0].token_ids[:4] == ref.tokens[:4]


def test_kv_snapshot_and_stats_skip_freed_entries(mistral):
    """The dashboard's snapshot invariants hold at every step while blocks are being freed
    (parallel samples sharing a prefix, prefix caching on)."""
    _, folder, prompts = mistral
    engine = make_llm(folder, num_blocks=16, enable_prefix_caching=True).engine
    engine.enable_kv_stats()
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=40, ignore_eos=True)
    engine.add_request("a", prompts[1], params)
    engine.add_request("b", prompts[2], params)
    freed_seen, step, st = 0, 0, engine.stats
    while engine.has_unfinished_requests():
        before = st.blocks_unshared_sum
        engine.step()
        step += 1
        if step > 3:  # past the prefills: 4 sequences, each within its window's blocks
            assert st.blocks_unshared_sum - before <= 4 * (-(-WINDOW // BLOCK) + 1)
        snap = kv_snapshot(engine)
        check_snapshot(snap, engine)
        tables = [s["block_table"] for r in snap["requests"] for s in r["seqs"]]
        freed_seen += sum(t.count(FREED_BLOCK) for t in tables if t)
        for r in snap["requests"]:
            for s in r["seqs"]:
                if s["pool"] == "device":
                    assert s["num_blocks"] <= max(-(-WINDOW // BLOCK) + 1, -(-70 // BLOCK))
    assert freed_seen > 0


def test_only_all_windowed_models_free_blocks():
    assert uniform_sliding_window([32, 32]) == 32
    assert uniform_sliding_window([8, None]) is None  # Gemma 2 / 3: global layers need all
    assert uniform_sliding_window([None, None]) is None
    assert uniform_sliding_window([]) is None


@pytest.fixture(scope="module")
def mistral_w8(tmp_path_factory):
    """A tiny Mistral with a window of 8: two blocks of 4."""
    folder = tmp_path_factory.mktemp("tiny-mistral-w8")
    build_tiny_hf_model("mistral", folder, sliding_window=8, max_position_embeddings=256)
    return folder


def test_a_windowed_readmission_too_big_for_one_chunk_is_not_capped(mistral_w8):
    """6 blocks of 4, budget 6, recompute: an n = 2 group (8-token prompt) is preempted beside
    an older greedy request and comes back after it. The lead's window frees the prompt block
    its sample would share, so the sample recomputes its prefix in chunks of its own; in the
    step before the lead's last token no block is free and the sample's 3-token chunk needs one:
    2 tokens fit in the block it holds. Judged on the 3-token chunk, the group was finished by
    length at 7 and 5 of 8 tokens; now every output equals a run in a roomy pool."""
    from pagedllm.entrypoints.llm import LLM
    from tests.engine.test_preemption import _bounded_outputs, _greedy

    sampled = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    requests = [([100], _greedy(13)), (list(range(10, 18)), sampled)]
    kw = dict(dtype="float32", block_size=4, max_model_len=64, preemption_mode="recompute",
              enable_prefix_caching=False, enable_chunked_prefill=True, max_num_batched_tokens=6,
              check_invariants=True)
    small = LLM(str(mistral_w8), num_gpu_blocks_override=6, **kw)
    got = _bounded_outputs(small, requests)
    assert [[len(t) for t in r] for r in got] == [[13], [8, 8]]
    assert small.engine.scheduler.preemptions_by_mode["recompute"] > 0
    bm = small.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks == 6
    assert got == _bounded_outputs(LLM(str(mistral_w8), num_gpu_blocks_override=64, **kw), requests)


def _windowed_llm(folder, blocks, **kw):
    from pagedllm.entrypoints.llm import LLM

    return LLM(str(folder), dtype="float32", block_size=4, max_model_len=64,
               preemption_mode="recompute", enable_prefix_caching=False,
               enable_chunked_prefill=True, check_invariants=True,
               num_gpu_blocks_override=blocks, **kw)


def test_a_windowed_readmission_that_outgrew_the_pool_is_not_capped(mistral_w8):
    """7 blocks of 4, budget 12, recompute: an n = 2 group (19-token prompt, 4 tokens each) is
    preempted beside an older greedy request; when it comes back with the pool to itself its
    whole sequences need 6 + 2 blocks, but recomputed chunk by chunk the window frees the
    blocks behind each chunk. Judged on whole sequences, it was finished by length at 2 and
    2 tokens; now every output equals a run in a roomy pool and every block is free."""
    from tests.engine.test_preemption import _bounded_outputs, _greedy

    sampled = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True)
    requests = [(list(range(100, 106)), _greedy(12)), (list(range(10, 29)), sampled)]
    small = _windowed_llm(mistral_w8, 7, max_num_batched_tokens=12)
    got = _bounded_outputs(small, requests)
    assert [[len(t) for t in r] for r in got] == [[12], [4, 4]]
    assert small.engine.scheduler.preemptions_by_mode["recompute"] > 0
    bm = small.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks == 7
    roomy = _windowed_llm(mistral_w8, 256, max_num_batched_tokens=12)
    assert got == _bounded_outputs(roomy, requests)


def test_a_long_windowed_sequence_readmitted_alone_is_not_capped(mistral_w8):
    """5 blocks of 4, budget 8, priority policy: a greedy request (6-token prompt, 40 tokens)
    is preempted by recompute for a more urgent one that came later, at 23 output tokens, when
    its whole sequence (29 tokens, 8 blocks) had outgrown the pool; alone again it is
    recomputed chunk by chunk (3 blocks at most). It was finished by length at 23 tokens;
    now it equals a roomy run and every block is free."""

    def run(blocks):
        llm = _windowed_llm(mistral_w8, blocks, max_num_batched_tokens=8,
                            scheduling_policy="priority")
        engine = llm.engine
        greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        engine.add_request("long", list(range(10, 16)), greedy, priority=1)
        done = {}
        for step in range(200):  # bounded: a stall fails below instead of hanging
            if step == 20:
                urgent = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
                engine.add_request("urgent", list(range(100, 108)), urgent, priority=0)
            done.update((o.request_id, list(o.outputs[0].token_ids)) for o in engine.step()
                        if o.finished)
            if step > 20 and not engine.has_unfinished_requests():
                break
        assert not engine.has_unfinished_requests(), "stalled"
        return done, engine

    got, engine = run(5)
    assert {k: len(v) for k, v in got.items()} == {"long": 40, "urgent": 4}
    assert engine.scheduler.preemptions_by_mode["recompute"] == 1
    assert engine.block_manager.num_free_blocks == 5
    assert got == run(256)[0]
