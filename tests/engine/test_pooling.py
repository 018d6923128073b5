"""Pooling (embedding) requests through the engine, against transformers' final hidden states.

A tiny random Llama built with transformers (``build_tiny_hf_model``) is the reference: its
``last_hidden_state`` (after the final norm) pooled by mean or last token, L2-normalized or not.
Covered: mixed lengths in one batch, chunked prefill, a prompt whose prefix is in the prefix
cache (the hit must not be taken: every position's hidden state is needed), a pooling request
batched with generation requests, and bad input. Every test ends with every KV block free.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.engine import pooling
from pagedllm.entrypoints.llm import LLM
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from tests.model.arch_utils import build_tiny_hf_model

PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "hello",
    "paged attention stores keys and values in blocks; a block table maps logical blocks "
    "to physical blocks",
]


@pytest.fixture(scope="module")
def hf_and_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama_pool")
    return build_tiny_hf_model("llama", folder), folder


def make_llm(folder, **over) -> LLM:
    kw = dict(
        dtype="float32",
        max_model_len=256,
        kv_cache_memory=1 << 22,
        block_size=4,
        check_invariants=True,
        num_threads=1,
    )
    return LLM(model=str(folder), **{**kw, **over})


@pytest.fixture(scope="module")
def llm(hf_and_folder):
    engine = make_llm(hf_and_folder[1])
    yield engine
    engine.engine.shutdown()


@pytest.fixture(autouse=True)
def _no_leak(llm):
    yield
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


@torch.no_grad()
def reference(model, ids: list[int], pooling_type: str, normalize: bool) -> torch.Tensor:
    h = model.model(torch.tensor([ids])).last_hidden_state[0].float()  # [L, H], final norm
    e = h.mean(0) if pooling_type == "mean" else h[-1]
    return torch.nn.functional.normalize(e, dim=0) if normalize else e


def check(got: list[float] | None, want: torch.Tensor, normalize: bool) -> None:
    assert got is not None
    g = torch.tensor(got)
    assert g.shape == want.shape
    cos = float(torch.nn.functional.cosine_similarity(g, want, dim=0))
    assert cos > 0.9999, cos
    if normalize:
        assert abs(float(g.norm()) - 1.0) < 1e-5
    else:
        assert abs(float(g.norm()) - float(want.norm())) < 1e-4 * float(want.norm())
        assert float(want.norm()) > 1.5  # a raw state is not accidentally unit-length


@pytest.mark.parametrize("pooling_type", ["mean", "last"])
@pytest.mark.parametrize("normalize", [True, False])
def test_embed_batch_mixed_lengths_equals_transformers(llm, hf_and_folder, pooling_type, normalize):
    model, _ = hf_and_folder
    tok = llm.get_tokenizer()
    outs = llm.embed(PROMPTS, PoolingParams(pooling_type, normalize), use_tqdm=False)
    assert len(outs) == len(PROMPTS)
    for p, out in zip(PROMPTS, outs, strict=True):
        ids = tok(p).input_ids
        assert out.finished and out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "stop"
        check(out.embedding, reference(model, ids, pooling_type, normalize), normalize)


def test_embed_prefix_cache_hit_is_not_skipped(llm, hf_and_folder):
    """The long prompt's first blocks are cached by a generation request first; embedding a
    prompt sharing them must still pool every position (mean pooling over the whole prompt)."""
    model, _ = hf_and_folder
    tok = llm.get_tokenizer()
    base = PROMPTS[2]
    llm.generate(base, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    ids = tok(base + " and more").input_ids
    bm = llm.engine.block_manager
    probe = llm.engine.input_processor.process("probe", ids, SamplingParams())
    assert len(bm.cached_prefix_blocks(probe.seqs[0])) >= 4  # the prefix is in the cache
    (out,) = llm.embed([ids], use_tqdm=False)
    assert out.num_cached_tokens == 0
    check(out.embedding, reference(model, ids, "mean", True), True)
    # And the raw mean (not normalized) matches too: no position was dropped from the sum.
    (raw,) = llm.embed([ids], PoolingParams(normalize=False), use_tqdm=False)
    check(raw.embedding, reference(model, ids, "mean", False), False)


def test_embed_with_chunked_prefill_and_generation_in_batch(hf_and_folder):
    model, folder = hf_and_folder
    # max_num_batched_tokens=8: the long prompt takes several steps.
    chunked = make_llm(folder, enable_chunked_prefill=True, max_num_batched_tokens=8)
    try:
        tok = chunked.get_tokenizer()
        engine = chunked.engine
        engine.add_request("gen", "hello world", SamplingParams(max_tokens=4, temperature=0))
        embed_params = SamplingParams(detokenize=False, pooling=PoolingParams("mean", False))
        engine.add_request("emb", PROMPTS[2], embed_params)
        done = {}
        steps = 0
        while engine.has_unfinished_requests():
            steps += 1
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
        assert steps > 3
        assert len(done["gen"].outputs[0].token_ids) == 4
        ids = tok(PROMPTS[2]).input_ids
        check(done["emb"].embedding, reference(model, ids, "mean", False), False)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        chunked.engine.shutdown()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_embed_preempted_mid_prefill(hf_and_folder, mode):
    """A pooling request preempted between two prefill chunks (recompute: its pool restarts
    from position 0; swap: it continues) still equals the reference."""
    from pagedllm.core.scheduler_output import SchedulerOutput

    model, folder = hf_and_folder
    llm = make_llm(
        folder, enable_chunked_prefill=True, max_num_batched_tokens=8, preemption_mode=mode
    )
    try:
        engine = llm.engine
        params = SamplingParams(detokenize=False, pooling=PoolingParams("mean", False))
        engine.add_request("emb", PROMPTS[2], params)
        engine.step()
        group = engine.requests["emb"]
        assert 0 < group.seqs[0].num_computed_tokens < group.seqs[0].num_prompt_tokens
        moves = SchedulerOutput()
        engine.scheduler._preempt(group, moves)
        # Outside a step, the worker applies the swap-out the scheduler planned here.
        engine.executor.worker.cache.swap_out(moves.blocks_to_swap_out)
        assert bool(moves.blocks_to_swap_out) == (mode == "swap")
        assert engine.scheduler.num_preemptions == 1
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
        ids = llm.get_tokenizer()(PROMPTS[2]).input_ids
        check(outs[0].embedding, reference(model, ids, "mean", False), False)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.shutdown()


def test_accumulate_restarts_at_zero_and_refuses_gaps():
    h = torch.arange(12, dtype=torch.float32).view(4, 3)
    st = pooling.accumulate(None, 0, h[:2])
    st = pooling.accumulate(st, 2, h[2:])
    assert st.count == 4 and torch.equal(st.total, h.sum(0)) and torch.equal(st.last, h[3])
    again = pooling.accumulate(st, 0, h[:1])  # a recompute starts over
    assert again.count == 1 and torch.equal(again.total, h[0])
    with pytest.raises(ValueError, match="does not continue"):
        pooling.accumulate(st, 5, h[:1])
    with pytest.raises(ValueError, match="every position"):
        pooling.accumulate(None, 3, h[:1])
    mean = pooling.pooled_embedding(st, PoolingParams("mean", False))
    assert mean == pytest.approx(h.mean(0).tolist())
    last = pooling.pooled_embedding(st, PoolingParams("last", True))
    assert last == pytest.approx((h[3] / h[3].norm()).tolist())


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ("", SamplingParams(pooling=PoolingParams()), "prompt"),
        ([999999], SamplingParams(pooling=PoolingParams()), "prompt"),
        ([5] * 257, SamplingParams(pooling=PoolingParams()), "prompt"),
        ("hi", SamplingParams(n=2, pooling=PoolingParams()), "n"),
    ],
)
def test_embed_bad_input(llm, prompt, params, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        llm.generate(prompt, params, use_tqdm=False)


def test_pooling_params_validation():
    with pytest.raises(ValueError, match="^pooling_type"):
        PoolingParams("cls")
    with pytest.raises(ValueError, match="^normalize"):
        PoolingParams("mean", 1)  # type: ignore[arg-type]


def test_pooling_params_come_from_the_package_root():
    """The README's ``from pagedllm import LLM, PoolingParams`` works (a new user found the
    class only in ``pagedllm.pooling_params``)."""
    import pagedllm

    assert pagedllm.PoolingParams is PoolingParams and "PoolingParams" in pagedllm.__all__


def test_embed_may_fill_the_pool_exactly(hf_and_folder):
    """A pooling request generates no token: a prompt of exactly the pool's tokens is embedded;
    one more token is refused naming the prompt (it said ``n``, samples and output tokens)."""
    model, folder = hf_and_folder
    llm = make_llm(folder, num_gpu_blocks_override=8)  # 8 blocks x 4 tokens
    try:
        ids = [5 + i % 90 for i in range(32)]
        out = llm.generate(ids, SamplingParams(pooling=PoolingParams("mean", False)), use_tqdm=False)
        check(out[0].embedding, reference(model, ids, "mean", False), False)
        with pytest.raises(ValueError, match=r"^prompt: a prompt of 33 tokens needs more KV") as e:
            llm.generate(ids + [7], SamplingParams(pooling=PoolingParams()), use_tqdm=False)
        assert e.value.param == "prompt"  # type: ignore[attr-defined]
    finally:
        llm.engine.shutdown()
