"""Speculative decoding end to end on the tiny random Llama (fp32): outputs equal the
speculation-off engine's (greedy, seeded sampling, penalties, logprobs, n > 1, stops), under
preemption (swap, recompute), chunked prefill and prefix caching; no KV block leaked after a
stress run with aborts (issue 25). ``tiny_llm_factory`` checks the pool invariants after every
step and that every block is free at the end."""

from collections.abc import Sequence

import pytest
import torch

from pagedllm.sampling_params import SamplingParams
from tests.spec_decode.stress import drive_with_aborts

# learn_step_cost off: these tests count drafts, which a timing-learned policy may cut.
SPEC = ('{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 64, '
        '"learn_step_cost": false}')
PROMPTS = [
    [10, 11, 12, 13, 14] * 6,
    list(range(20, 60)),
    [5, 6, 7] * 10 + [8, 9],
    list(range(100, 140)) + list(range(100, 120)),
]
CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    "greedy_logprobs_penalties": SamplingParams(
        temperature=0, max_tokens=20, logprobs=2, repetition_penalty=1.3, frequency_penalty=0.5,
        ignore_eos=True,
    ),
    "seeded": SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True),
    "n2_seeded": SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=24, ignore_eos=True),
    "stop_tokens": SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[378, 65]),
}


def run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]


class OracleProposer:
    """Proposes the reference continuation (all accepted for greedy), or garbage (``wrong``)."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], wrong: bool = False) -> None:
        self.reference = reference
        self.wrong = wrong

    def propose(self, token_ids: Sequence[int], num_prompt_tokens: int, k: int, request_id: str) -> list[int]:
        ref = self.reference[tuple(token_ids[:num_prompt_tokens])]
        out = ref[len(token_ids) - num_prompt_tokens :][:k]
        return [(t + 1) % 300 for t in out] if self.wrong else out

    def on_request_finished(self, token_ids: Sequence[int], num_prompt_tokens: int, request_id: str) -> None:
        pass


@pytest.fixture(scope="module")
def reference(tiny_loaded):
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(loaded=tiny_loaded, max_model_len=256, kv_cache_memory=1 << 22)
    return {case: run(llm, PROMPTS, sp) for case, sp in CASES.items()}


def oracle(reference, case="greedy", wrong=False):
    return OracleProposer({tuple(p): r[0][0] for p, r in zip(PROMPTS, reference[case], strict=True)}, wrong)


@pytest.mark.parametrize("case", list(CASES))
def test_ngram_outputs_equal_speculation_off(tiny_llm_factory, reference, case):
    llm = tiny_llm_factory(speculative_config=SPEC)
    assert run(llm, PROMPTS, CASES[case]) == reference[case]
    st = llm.engine.stats
    assert st.spec_accepted_tokens <= st.spec_draft_tokens
    assert sum(st.spec_accepted_per_pos) == st.spec_accepted_tokens
    assert sum(st.spec_draft_per_pos) == st.spec_draft_tokens
    if case == "greedy":  # the others rarely repeat themselves on a random model
        assert st.spec_accepted_tokens > 0
    # The proposals of the reference's own output: the accepted path of every case.
    llm.engine.engine_core.speculator.proposer = oracle(reference, case)
    before = st.spec_accepted_tokens
    assert run(llm, PROMPTS, CASES[case]) == reference[case]
    assert llm.engine.stats.spec_accepted_tokens > before


def test_logprobs_equal_speculation_off(tiny_llm_factory, tiny_loaded):
    sp = CASES["greedy_logprobs_penalties"]
    off = tiny_llm_factory().generate(PROMPTS, sp, use_tqdm=False)
    on = tiny_llm_factory(speculative_config=SPEC).generate(PROMPTS, sp, use_tqdm=False)
    for a, b in zip(off, on, strict=True):
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert len(la) == len(lb) == len(a.outputs[0].token_ids)
        for pa, pb in zip(la, lb, strict=True):
            assert list(pa) == list(pb)  # same tokens, same order (sampled, then top-2)
            for t in pa:
                assert pa[t].logprob == pytest.approx(pb[t].logprob, abs=1e-4)


def test_oracle_proposals_all_accepted(tiny_llm_factory, reference):
    llm = tiny_llm_factory(speculative_config=SPEC)
    llm.engine.engine_core.speculator.proposer = oracle(reference)
    assert run(llm, PROMPTS, CASES["greedy"]) == reference["greedy"]
    st = llm.engine.stats
    assert st.spec_accepted_tokens == st.spec_draft_tokens > 0
    # k grows past 4 only up to the request's cap; every verification emits k + 1 tokens.
    assert st.spec_draft_per_pos == st.spec_accepted_per_pos
    assert st.spec_mean_accepted_length > 4.0


def test_wrong_proposals_all_rejected(tiny_llm_factory, reference):
    llm = tiny_llm_factory(speculative_config=SPEC)
    llm.engine.engine_core.speculator.proposer = oracle(reference, wrong=True)
    assert run(llm, PROMPTS, CASES["greedy"]) == reference["greedy"]
    st = llm.engine.stats
    assert st.spec_accepted_tokens == 0 and st.spec_draft_tokens > 0
    assert st.spec_mean_accepted_length == 1.0


@pytest.mark.parametrize(("mode", "case"), [("swap", "n2_seeded"), ("recompute", "greedy")])
def test_outputs_equal_under_preemption(tiny_llm_factory, reference, mode, case):
    llm = tiny_llm_factory(
        speculative_config=SPEC, block_size=16, num_gpu_blocks_override=12, preemption_mode=mode,
    )
    llm.engine.engine_core.speculator.proposer = oracle(reference, case)
    assert run(llm, PROMPTS, CASES[case]) == reference[case]
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.stats.spec_accepted_tokens > 0


@pytest.mark.parametrize("caching", [True, False])
def test_chunked_prefill_and_prefix_caching(tiny_llm_factory, reference, caching):
    llm = tiny_llm_factory(
        speculative_config=SPEC, enable_chunked_prefill=True, max_num_batched_tokens=24,
        enable_prefix_caching=caching, block_size=8,
    )
    llm.engine.engine_core.speculator.proposer = oracle(reference)
    for _ in range(2):  # the second round hits the blocks the first one registered
        assert run(llm, PROMPTS, CASES["greedy"]) == reference["greedy"]
    pc = llm.engine.block_manager.prefix_cache
    assert (pc is not None and pc.hits > 0) == caching


def test_per_request_k_and_off(tiny_llm_factory, reference):
    llm = tiny_llm_factory(speculative_config=SPEC)
    llm.engine.engine_core.speculator.proposer = oracle(reference)
    off = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, num_speculative_tokens=0)
    assert run(llm, PROMPTS, off) == reference["greedy"]
    assert llm.engine.stats.spec_draft_tokens == 0
    two = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, num_speculative_tokens=2)
    assert run(llm, PROMPTS, two) == reference["greedy"]
    assert len(llm.engine.stats.spec_draft_per_pos) == 2


def test_batch_size_cutoff(tiny_llm_factory, reference):
    llm = tiny_llm_factory(speculative_config='{"method": "ngram", "disable_by_batch_size": 4}')
    assert run(llm, PROMPTS, CASES["greedy"]) == reference["greedy"]
    assert llm.engine.stats.spec_draft_tokens == 0  # 4 decoding sequences: never speculates
    assert run(llm, PROMPTS[:3], CASES["greedy"]) == reference["greedy"][:3]
    assert llm.engine.stats.spec_draft_tokens > 0


def test_requests_refused_with_clear_errors(tiny_llm_factory):
    llm = tiny_llm_factory()
    with pytest.raises(ValueError, match="num_speculative_tokens needs an engine"):
        llm.generate([PROMPTS[0]], SamplingParams(num_speculative_tokens=2), use_tqdm=False)


@pytest.mark.slow
def test_stress_aborts_and_preemption_leak_nothing(tiny_llm_factory):
    llm = tiny_llm_factory(
        speculative_config=SPEC, block_size=8, num_gpu_blocks_override=24, preemption_mode="auto",
    )
    engine = llm.engine
    drive_with_aborts(engine, PROMPTS, num_requests=24, max_tokens_hi=32)
    assert engine.stats.spec_draft_tokens > 0 and engine.scheduler.num_preemptions > 0


def test_suffix_proposer_outputs_equal_speculation_off(tiny_llm_factory, reference):
    llm = tiny_llm_factory(speculative_config='{"method": "suffix", "num_speculative_tokens": 4, "learn_step_cost": false}')
    for _ in range(2):  # the second round also matches the first round's outputs
        assert run(llm, PROMPTS, CASES["greedy"]) == reference["greedy"]
    st = llm.engine.stats
    assert 0 < st.spec_accepted_tokens <= st.spec_draft_tokens


def test_engine_wide_k_has_the_request_bound_and_float16_is_flagged(tiny_loaded, caplog):
    """num_speculative_tokens is bounded engine-wide as per request (32); float16 on CPU warns
    that its ATen matmuls can flip near-tied greedy tokens under speculation (a new user found
    output differing from speculation off there)."""
    import logging

    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import MAX_SPECULATIVE_TOKENS

    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens must be <= 32"):
        LLM(loaded=tiny_loaded, speculative_config={"method": "ngram", "num_speculative_tokens": 10**9})
    spec = {"method": "ngram", "num_speculative_tokens": MAX_SPECULATIVE_TOKENS}
    with caplog.at_level(logging.WARNING, logger="pagedllm.engine.llm_engine"):
        LLM(loaded=tiny_loaded, max_model_len=64, kv_cache_memory=1 << 20, speculative_config=spec)
        assert "float16" not in caplog.text
        LLM(loaded=tiny_loaded, dtype="float16", max_model_len=64, kv_cache_memory=1 << 20,
            speculative_config=spec)
    assert "speculative decoding with dtype float16 on CPU" in caplog.text


def test_a_quantized_kv_cache_is_flagged(tiny_loaded, caplog):
    """A draft's K / V row can requantize its block's earlier rows in an fp8 / int8 cache, and
    the rollback keeps that, so output can leave speculation off's (a new user saw it with GGUF
    weights and an int8 cache): the engine warns; not for a float32 cache."""
    import logging

    from pagedllm.entrypoints.llm import LLM

    spec = {"method": "ngram", "num_speculative_tokens": 4}
    flag = "speculative decoding with kv_cache_dtype"
    with caplog.at_level(logging.WARNING, logger="pagedllm.engine.llm_engine"):
        LLM(loaded=tiny_loaded, max_model_len=64, kv_cache_memory=1 << 20, speculative_config=spec)
        assert flag not in caplog.text
        for kv in ("int8", "fp8_e4m3"):
            LLM(loaded=tiny_loaded, max_model_len=64, kv_cache_memory=1 << 20,
                kv_cache_dtype=kv, speculative_config=spec)
            assert f"{flag} {kv}:" in caplog.text


def test_bfloat16_is_flagged_where_aten_runs_its_matmuls(tiny_loaded, caplog, monkeypatch):
    """ATen's (and oneDNN's) bfloat16 matmuls give bits that depend on the row count, so greedy
    speculation can differ from speculation off there (a new user saw it under tp 3, where the
    row-parallel layers ran ATen): the engine warns exactly where the own GEMM does not run the
    linears (tensor parallelism included since the row-parallel layers are packed too)."""
    import logging

    from pagedllm.entrypoints.llm import LLM
    from pagedllm.model.packed_linear import own_gemm_runs

    spec = {"method": "ngram", "num_speculative_tokens": 4}
    kw = dict(loaded=tiny_loaded, dtype="bfloat16", max_model_len=64, kv_cache_memory=1 << 20,
              speculative_config=spec)
    flag = "speculative decoding with dtype bfloat16 on CPU"
    with caplog.at_level(logging.WARNING, logger="pagedllm.engine.llm_engine"):
        LLM(**kw)
        assert (flag in caplog.text) == (not own_gemm_runs(torch.bfloat16))
        caplog.clear()
        monkeypatch.setenv("PAGEDLLM_DISABLE_PACKED_LINEAR", "1")  # every linear on ATen
        LLM(**kw)
        assert flag in caplog.text
