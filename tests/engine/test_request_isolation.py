"""One request's failure in its own part of a step (sampling, output processing) aborts that
request alone: the others finish with the tokens they get alone, every block is free (the
``tiny_llm_factory`` fixture checks the pool after each test) and the failed request's output
is finished "abort" with the exception in ``RequestOutput.error``."""

import torch

from pagedllm.sampling.sampler import SamplingBatch
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured.mask import TokenBitmask
from tests.spec_decode.test_draft_model import near_draft  # noqa: F401 (fixture)
from tests.spec_decode.test_spec_engine import OracleProposer

PROMPTS = ["hello world", "the quick brown fox jumps", "a block table maps logical blocks"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=8, ignore_eos=True)
MARKED_TOP_K = 7  # the failing request is the one with this top_k


def alone(llm, prompt, params):
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def run_all(eng):
    finished = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def fail_marked_rows(sampler, after=1):
    """Make ``sampler`` raise whenever a batch holds a marked row, from the ``after``-th such
    batch on (its row processing, which every sampling path runs first)."""
    real = sampler._process
    calls = {"n": 0}

    def process(raw, batch):
        if any(p.top_k == MARKED_TOP_K for p in batch.params):
            calls["n"] += 1
            if calls["n"] >= after:
                raise RuntimeError("injected")
        return real(raw, batch)

    sampler._process = process


def test_a_failing_sampler_row_fails_its_request_alone(tiny_llm_factory):
    llm = tiny_llm_factory(block_size=4)
    eng = llm.engine
    want_greedy = alone(llm, PROMPTS[0], GREEDY)
    want_seeded = alone(llm, PROMPTS[2], SEEDED)
    bad = SamplingParams(temperature=1.0, top_k=MARKED_TOP_K, n=2, max_tokens=8, ignore_eos=True)
    fail_marked_rows(eng.engine_core.sampler, after=3)
    eng.add_request("greedy", PROMPTS[0], GREEDY)
    eng.add_request("bad", PROMPTS[1], bad)
    eng.add_request("seeded", PROMPTS[2], SEEDED)
    finished = run_all(eng)
    assert finished["greedy"].outputs[0].token_ids == want_greedy
    assert finished["seeded"].outputs[0].token_ids == want_seeded
    assert finished["greedy"].error is None and finished["seeded"].error is None
    out = finished["bad"]
    assert out.error == "RuntimeError: injected"
    assert [c.finish_reason for c in out.outputs] == ["abort", "abort"]
    # Two steps sampled before the failure: the samples keep those tokens.
    assert [len(c.token_ids) for c in out.outputs] == [2, 2]
    assert eng.block_manager.num_free_blocks == eng.num_blocks


def test_a_lone_failing_request_does_not_fail_the_step(tiny_llm_factory):
    """Alone in its step, the failing request is still failed by itself: a request still in
    its prefill (no sample this step) goes on."""
    llm = tiny_llm_factory(block_size=4, max_num_batched_tokens=8, enable_chunked_prefill=True)
    eng = llm.engine
    long_prompt = " ".join(PROMPTS * 3)
    want = alone(llm, long_prompt, GREEDY)
    fail_marked_rows(eng.engine_core.sampler)
    eng.add_request("bad", PROMPTS[0], SamplingParams(top_k=MARKED_TOP_K, max_tokens=4))
    eng.add_request("long", long_prompt, GREEDY)
    finished = run_all(eng)
    assert finished["bad"].error == "RuntimeError: injected"
    assert finished["bad"].outputs[0].token_ids == []
    assert finished["long"].outputs[0].token_ids == want and finished["long"].error is None


def test_a_failing_output_processing_fails_its_request_alone(tiny_llm_factory):
    llm = tiny_llm_factory(block_size=4)
    eng = llm.engine
    want = alone(llm, PROMPTS[0], GREEDY)
    processor = eng.engine_core.output_processor
    real = processor.process_sample

    def process_sample(seq, group, out, row):
        if group.request_id == "bad" and seq.num_output_tokens == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(seq, group, out, row)

    processor.process_sample = process_sample
    eng.add_request("bad", PROMPTS[1], GREEDY)
    eng.add_request("greedy", PROMPTS[0], GREEDY)
    finished = run_all(eng)
    assert finished["greedy"].outputs[0].token_ids == want
    assert finished["bad"].error.startswith("UnicodeDecodeError: ")
    assert finished["bad"].outputs[0].finish_reason == "abort"
    assert eng.block_manager.num_free_blocks == eng.num_blocks


def test_select_keeps_the_grammar_mask_of_the_rows_it_takes():
    bits = torch.arange(12, dtype=torch.int32).reshape(4, 3)
    batch = SamplingBatch(
        [GREEDY] * 4, [1, 2, 3, 4], [[]] * 4, [[5]] * 4, [0], TokenBitmask(bits, [1, 3])
    )
    sub = batch.select([3, 0])
    assert sub.seeds == [4, 1]
    assert sub.token_bitmask is not None and sub.token_bitmask.rows == [0]
    assert torch.equal(sub.token_bitmask.bitmask, bits[[3, 0]])
    assert batch.select([0, 2]).token_bitmask is None
    assert SamplingBatch([GREEDY], [1], [[]], [[5]], [0]).select([0]).token_bitmask is None


SPEC = ('{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 64, '
        '"learn_step_cost": false}')
REPETITIVE = ["abab abab abab abab abab", "hello hello hello hello", "one two one two one two"]


def test_speculative_verification_fails_a_request_alone(tiny_llm_factory):
    """Under speculation, a request whose verify rows raise in the sampler, or whose output
    processing raises while its accepted drafts are emitted, fails alone."""
    off = tiny_llm_factory()
    want = [alone(off, p, GREEDY) for p in REPETITIVE]
    llm = tiny_llm_factory(block_size=4, speculative_config=SPEC)
    eng = llm.engine
    ids = [tuple(llm.get_tokenizer().encode(p)) for p in REPETITIVE]
    # Drafts that are the speculation-off answers: all accepted.
    eng.engine_core.speculator.proposer = OracleProposer(dict(zip(ids, want, strict=True)))
    fail_marked_rows(eng.engine_core.sampler, after=3)
    processor = eng.engine_core.output_processor
    real = processor.process_sample

    def process_sample(seq, group, out, row):
        if group.request_id == "bad-output" and seq.num_output_tokens == 4:
            raise RuntimeError("injected output")
        return real(seq, group, out, row)

    processor.process_sample = process_sample
    marked = SamplingParams(temperature=0, top_k=MARKED_TOP_K, max_tokens=8, ignore_eos=True)
    eng.add_request("ok0", REPETITIVE[0], GREEDY)
    eng.add_request("bad-sampler", REPETITIVE[1], marked)
    eng.add_request("ok2", REPETITIVE[2], GREEDY)
    eng.add_request("bad-output", REPETITIVE[0], GREEDY)
    finished = run_all(eng)
    assert finished["ok0"].outputs[0].token_ids == want[0]
    assert finished["ok2"].outputs[0].token_ids == want[2]
    assert finished["bad-sampler"].error == "RuntimeError: injected"
    assert finished["bad-output"].error == "RuntimeError: injected output"
    assert {finished[r].outputs[0].finish_reason for r in ("bad-sampler", "bad-output")} == {"abort"}
    assert eng.stats.spec_accepted_tokens > 0  # verification really ran
    assert eng.block_manager.num_free_blocks == eng.num_blocks


def test_draft_model_verification_fails_a_request_alone(tiny_llm_factory, near_draft):  # noqa: F811
    """With a draft model, a request whose verify rows raise fails alone, and the seeded
    request beside it keeps its rejection sampling: the tokens it gets alone."""
    from tests.spec_decode.test_draft_model import spec

    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)
    want = alone(tiny_llm_factory(speculative_config=spec(near_draft)), PROMPTS[0], seeded)
    llm = tiny_llm_factory(speculative_config=spec(near_draft))
    eng = llm.engine
    sampler = eng.engine_core.sampler
    real = sampler._process

    def process(raw, batch):  # verify batches only: k + 1 rows of the marked request
        if sum(p.top_k == MARKED_TOP_K for p in batch.params) > 1:
            raise RuntimeError("injected")
        return real(raw, batch)

    sampler._process = process
    eng.add_request("ok", PROMPTS[0], seeded)
    eng.add_request("bad", PROMPTS[1], SamplingParams(temperature=0.8, seed=3, top_k=MARKED_TOP_K,
                                                      max_tokens=10, ignore_eos=True))
    finished = run_all(eng)
    assert finished["bad"].error == "RuntimeError: injected"
    assert finished["ok"].outputs[0].token_ids == want and finished["ok"].error is None
    assert eng.stats.spec_accepted_tokens > 0


def raise_for_marked(sampler):
    """A stand-in for ``sampler`` that raises on any batch holding a marked row (sampling or
    its probabilities) and is ``sampler`` otherwise."""

    class Failing:
        def _check(self, batch):
            if any(p.top_k == MARKED_TOP_K for p in batch.params):
                raise RuntimeError("injected draft")

        def __call__(self, logits, batch):
            self._check(batch)
            return sampler(logits, batch)

        def probs(self, logits, batch):
            self._check(batch)
            return sampler.probs(logits, batch)

    return Failing()


def test_failing_draft_sampling_keeps_the_request_exact(tiny_llm_factory, near_draft):  # noqa: F811
    """The draft model's own sampling raising for one request (the target's does not) leaves
    that request on placeholder drafts, which its verification compares with the target's own
    seeded samples: it ends with its speculation-off tokens (rejection sampling would give
    others, equally distributed). The seeded request beside it keeps its drafts and rejection
    sampling: the tokens it gets alone with the draft model."""
    from tests.spec_decode.test_draft_model import spec

    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)
    marked = SamplingParams(temperature=0.8, seed=3, top_k=MARKED_TOP_K, max_tokens=10,
                            ignore_eos=True)
    want = {"ok": alone(tiny_llm_factory(speculative_config=spec(near_draft)), PROMPTS[0], seeded),
            "marked": alone(tiny_llm_factory(), PROMPTS[1], marked)}
    llm = tiny_llm_factory(speculative_config=spec(near_draft))
    eng = llm.engine
    proposer = eng.engine_core.speculator.proposer
    proposer.sampler = raise_for_marked(proposer.sampler)
    eng.add_request("ok", PROMPTS[0], seeded)
    eng.add_request("marked", PROMPTS[1], marked)
    finished = run_all(eng)
    for rid in ("ok", "marked"):
        assert finished[rid].error is None
        assert finished[rid].outputs[0].token_ids == want[rid]
    assert eng.stats.spec_accepted_tokens > 0


def test_failing_draft_and_target_sampling_fail_the_request_alone(tiny_llm_factory, near_draft):  # noqa: F811
    """When both the draft's and the target's verify sampling raise for a request (a bad
    parameter reaches both), the step goes on: that request fails with the target's error, the
    greedy request beside it gets its own tokens."""
    from tests.spec_decode.test_draft_model import spec

    want = alone(tiny_llm_factory(speculative_config=spec(near_draft)), PROMPTS[0], GREEDY)
    llm = tiny_llm_factory(speculative_config=spec(near_draft))
    eng = llm.engine
    proposer = eng.engine_core.speculator.proposer
    proposer.sampler = raise_for_marked(proposer.sampler)
    sampler = eng.engine_core.sampler
    real = sampler._process

    def process(raw, batch):  # verify batches only, after the draft's sampling has raised
        if sum(p.top_k == MARKED_TOP_K for p in batch.params) > 1:
            raise RuntimeError("injected")
        return real(raw, batch)

    sampler._process = process
    eng.add_request("ok", PROMPTS[0], GREEDY)
    eng.add_request("bad", PROMPTS[1], SamplingParams(temperature=0.8, seed=3,
                                                      top_k=MARKED_TOP_K, max_tokens=10))
    finished = run_all(eng)
    assert finished["bad"].error == "RuntimeError: injected"
    assert finished["ok"].outputs[0].token_ids == want and finished["ok"].error is None
