"""The draft-model proposer end to end on tiny random Llamas (fp32, issue 25): the target as its
own draft accepts everything; a different tiny draft (same tokenizer) gives the speculation-off
greedy output in a mixed batch, with n = 2, under swap and recompute preemption, with prefix
caching; its cache mirrors the target's block ids (KV equal to the target's where the draft is
the target); sampled tokens follow the target's distribution (chi-square, with a negative
control); nothing leaks after aborts. ``tiny_llm_factory`` checks the pool invariants after
every step and that every block is free at the end."""

import math
from pathlib import Path

import pytest
import torch

from pagedllm.model.loader import LoadedModel
from pagedllm.sampling_params import SamplingParams
from tests.conftest import make_random_state_dict, make_tiny_config
from tests.spec_decode.stress import drive_with_aborts

PROMPTS = [
    [10, 11, 12, 13, 14] * 6,
    list(range(20, 60)),
    [5, 6, 7] * 10 + [8, 9],
    list(range(100, 140)) + list(range(100, 120)),
]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def spec(model, k=3, **extra):
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k,
            "disable_by_batch_size": 64, "learn_step_cost": False, **extra}  # fmt: skip


def run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]


def _loaded(tokenizer, sd, **over):
    cfg = make_tiny_config(over.pop("vocab_size", len(tokenizer)), tokenizer.eos_token_id, **over)
    return LoadedModel(config=cfg, state_dict=sd(cfg), tokenizer=tokenizer,
                       source=Path("<tiny-draft>"), weight_bytes=0)  # fmt: skip


@pytest.fixture(scope="module")
def small_draft(tiny_loaded):
    """A different, smaller random Llama with the target's tokenizer (1 layer, 1 KV head)."""
    return _loaded(tiny_loaded.tokenizer, lambda c: make_random_state_dict(c, seed=5),
                   num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                   num_key_value_heads=1)  # fmt: skip


@pytest.fixture(scope="module")
def near_draft(tiny_loaded):
    """The target with a perturbed LM head: q overlaps p but differs (some drafts rejected)."""
    g = torch.Generator().manual_seed(1)
    sd = dict(tiny_loaded.state_dict)
    head = sd["lm_head.weight"]
    sd["lm_head.weight"] = head + 0.6 * head.std() * torch.randn(head.shape, generator=g)
    return _loaded(tiny_loaded.tokenizer, lambda c: sd)


@pytest.fixture(scope="module")
def reference(tiny_loaded):
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(loaded=tiny_loaded, max_model_len=256, kv_cache_memory=1 << 22)
    return run(llm, PROMPTS, GREEDY)


def test_target_as_its_own_draft_accepts_everything(tiny_llm_factory, tiny_loaded, reference):
    llm = tiny_llm_factory(speculative_config=spec(tiny_loaded))
    assert run(llm, PROMPTS, GREEDY) == reference
    st = llm.engine.stats
    assert st.spec_draft_tokens > 0
    assert st.spec_acceptance_rate == 1.0
    assert st.spec_draft_per_pos == st.spec_accepted_per_pos


def test_budget_split_by_block_bytes(tiny_llm_factory, tiny_loaded, small_draft):
    # Target block: 2 layers x 2 KV heads x 16 dims x 2 (K, V) x 4 bytes x 16 tokens = 8 KiB;
    # the draft's: 1 x 1 x 16 x 2 x 4 x 16 = 2 KiB; 4 MiB / 10 KiB = 409 blocks for both.
    off = tiny_llm_factory()
    on = tiny_llm_factory(speculative_config=spec(small_draft))
    assert off.engine.num_blocks == (1 << 22) // 8192 == 512
    assert on.engine.num_blocks == (1 << 22) // (8192 + 2048) == 409
    cache = on.engine.engine_core.speculator.proposer.worker.cache
    assert cache.num_blocks == 409 and cache.total_bytes == 409 * 2048


def test_small_draft_mixed_batch_and_n2(tiny_llm_factory, small_draft, reference):
    llm = tiny_llm_factory(speculative_config=spec(small_draft, k=4))
    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=20, ignore_eos=True,
                             logprobs=1)  # fmt: skip
    n2 = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=20, ignore_eos=True)
    params = [GREEDY, sampled, GREEDY, n2]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    # Rejection-sampled tokens carry their own logprob and rank (the sampled token leads each
    # entry; when it is not the top-1 token, it ranks below it).
    lp = outs[1].outputs[0].logprobs
    assert [next(iter(d)) for d in lp] == list(outs[1].outputs[0].token_ids)
    for entry in lp:
        mine, *top = entry.values()
        assert (mine.rank == 1) == (not top)
        assert all(mine.logprob <= t.logprob and t.rank == 1 for t in top)
    first = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]
    assert first[0] == reference[0] and first[2] == reference[2]
    assert len(first[3]) == 2 and all(len(t) == 20 for t, _ in first[1] + first[3])
    assert run(llm, PROMPTS, params) == first  # seeded requests are reproducible
    st = llm.engine.stats
    assert st.spec_draft_tokens > 0 and sum(st.spec_draft_per_pos) == st.spec_draft_tokens
    assert not llm.engine.engine_core.speculator.proposer._computed  # state of finished seqs


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_and_mirrored_kv(tiny_llm_factory, tiny_loaded, reference, mode):
    """With the target as its own draft the draft cache must hold the target's K/V at every
    position the draft counts as computed, in the same block ids, after swaps, recomputes and
    rollbacks; output equals speculation off and every draft is still accepted."""
    llm = tiny_llm_factory(
        speculative_config=spec(tiny_loaded), block_size=8, num_gpu_blocks_override=14,
        preemption_mode=mode,
    )  # fmt: skip
    engine = llm.engine
    proposer = engine.engine_core.speculator.proposer
    target_cache = engine.executor.worker.cache.kv_caches
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, GREEDY)
    outs: dict[str, list[int]] = {}
    checked = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
        for group in engine.scheduler.running:
            for seq in group.unfinished_seqs():
                n = proposer._computed.get(seq.seq_id, 0)
                assert n <= seq.num_computed_tokens
                table = engine.block_manager.get_block_table(seq)
                pos = torch.arange(n)
                blocks = torch.tensor(table, dtype=torch.long)[pos // 8]
                for (tk, tv), (dk, dv) in zip(target_cache, proposer.worker.cache.kv_caches):
                    torch.testing.assert_close(dk[:, blocks, pos % 8], tk[:, blocks, pos % 8])
                    torch.testing.assert_close(dv[:, blocks, pos % 8], tv[:, blocks, pos % 8])
                checked += n
    assert [outs[str(i)] for i in range(len(PROMPTS))] == [r[0][0] for r in reference]
    assert engine.scheduler.preemptions_by_mode[mode] > 0 and checked > 0
    assert engine.stats.spec_acceptance_rate == 1.0


def test_prefix_caching_and_chunked_prefill(tiny_llm_factory, small_draft, reference):
    llm = tiny_llm_factory(
        speculative_config=spec(small_draft), enable_prefix_caching=True, block_size=8,
        enable_chunked_prefill=True, max_num_batched_tokens=24,
    )  # fmt: skip
    for _ in range(2):  # the second round hits the blocks the first one registered
        assert run(llm, PROMPTS, GREEDY) == reference
    assert llm.engine.block_manager.prefix_cache.hits > 0


@pytest.mark.slow
def test_aborts_and_preemption_leak_nothing(tiny_llm_factory, small_draft):
    llm = tiny_llm_factory(
        speculative_config=spec(small_draft), block_size=8, num_gpu_blocks_override=24,
        preemption_mode="auto",
    )  # fmt: skip
    engine = llm.engine
    drive_with_aborts(engine, PROMPTS, num_requests=20, max_tokens_hi=24)
    proposer = engine.engine_core.speculator.proposer
    assert engine.stats.spec_draft_tokens > 0 and engine.scheduler.num_preemptions > 0
    assert not proposer._computed and not proposer._request_of  # the draft side forgot all


def test_draft_must_share_the_tokenizer(tiny_llm_factory, tiny_loaded):
    other = _loaded(tiny_loaded.tokenizer, make_random_state_dict, vocab_size=128)
    with pytest.raises(ValueError, match="speculative_config.model"):
        tiny_llm_factory(speculative_config=spec(other))
    with pytest.raises(ValueError, match="speculative_config.model is required"):
        tiny_llm_factory(speculative_config={"method": "draft_model"})
    with pytest.raises(ValueError, match="speculative_config.model is only used"):
        tiny_llm_factory(speculative_config={"method": "ngram", "model": "x"})
    with pytest.raises(ValueError, match="speculative_config.model: .*not found"):
        tiny_llm_factory(speculative_config={"method": "draft_model",
                                             "model": "/nonexistent/draft.gguf"})


# ---- the sampled tokens follow the target's distribution ------------------------------------
TOP_K = 5
STAT_PROMPT = list(range(30, 42))
N_DRAWS = 1500


def _target_dist(logits: torch.Tensor) -> torch.Tensor:
    """The target's top-5, temperature-1 sampling distribution from raw logits."""
    kth = logits.topk(TOP_K).values[-1]
    return logits.masked_fill(logits < kth, float("-inf")).softmax(-1)


def _joint_reference(hf_model) -> dict[tuple[int, int], float]:
    """P(t1, t2) of the first two output tokens under the target (transformers)."""
    with torch.no_grad():
        p1 = _target_dist(hf_model(torch.tensor([STAT_PROMPT])).logits[0, -1].double())
        joint = {}
        for t1 in torch.nonzero(p1).flatten().tolist():
            ids = torch.tensor([[*STAT_PROMPT, t1]])
            p2 = _target_dist(hf_model(ids).logits[0, -1].double())
            for t2 in torch.nonzero(p2).flatten().tolist():
                joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return joint


def _chi2_p_value(counts: dict[tuple[int, int], int], joint: dict[tuple[int, int], float]) -> float:
    """Chi-square goodness of fit p-value (Wilson-Hilferty), a pair outside the support -> 0."""
    if set(counts) - set(joint):
        return 0.0
    n = sum(counts.values())
    chi2 = sum((counts.get(c, 0) - n * p) ** 2 / (n * p) for c, p in joint.items())
    df = len(joint) - 1
    z = ((chi2 / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _draw_pairs(tiny_llm_factory, near_draft) -> tuple[dict[tuple[int, int], int], object]:
    llm = tiny_llm_factory(
        speculative_config=spec(near_draft, k=1, disable_by_batch_size=4096), max_num_seqs=256,
    )  # fmt: skip
    params = [SamplingParams(temperature=1.0, top_k=TOP_K, seed=s, max_tokens=3, ignore_eos=True)
              for s in range(N_DRAWS)]  # fmt: skip
    counts: dict[tuple[int, int], int] = {}
    for out in llm.generate([STAT_PROMPT] * N_DRAWS, params, use_tqdm=False):
        pair = tuple(out.outputs[0].token_ids[:2])
        counts[pair] = counts.get(pair, 0) + 1  # type: ignore[index]
    return counts, llm.engine.stats


@pytest.mark.slow
def test_sampled_tokens_follow_the_target(tiny_llm_factory, near_draft, hf_tiny_model):
    joint = _joint_reference(hf_tiny_model)
    counts, st = _draw_pairs(tiny_llm_factory, near_draft)
    # The second token of every draw went through rejection sampling, some drafts rejected.
    assert st.spec_draft_tokens == N_DRAWS
    assert 0.2 * N_DRAWS < st.spec_accepted_tokens < 0.95 * N_DRAWS
    assert _chi2_p_value(counts, joint) > 1e-3


@pytest.mark.slow
def test_negative_control_ignoring_q_fails(tiny_llm_factory, near_draft, hf_tiny_model, monkeypatch):
    """A wrong rule (accept every draft the target allows, ignoring q) is caught by the test."""
    from pagedllm.spec_decode import draft_verify

    real = draft_verify.rejection_sample

    def accept_if_possible(target, tokens, num_draft, q, seeds, steps):
        return real(target, tokens, num_draft, torch.zeros_like(q), seeds, steps)

    monkeypatch.setattr(draft_verify, "rejection_sample", accept_if_possible)
    counts, _ = _draw_pairs(tiny_llm_factory, near_draft)
    assert _chi2_p_value(counts, _joint_reference(hf_tiny_model)) < 1e-3
