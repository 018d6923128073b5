"""One request's failure in its own part of a step (sampling, output processing) aborts that
request alone: the others finish with the tokens they get alone, every block is free (the
``tiny_llm_factory`` fixture checks the pool after each test) and the failed request's output
is finished "abort" with the exception in ``RequestOutput.error``."""

import torch

from pagedllm.sampling.sampler import SamplingBatch
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured.mask import TokenBitmask

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


class FailingSampler:
    """The engine's sampler, raising whenever a batch holds a marked row, from the
    ``after``-th such call on."""

    def __init__(self, sampler, after=1):
        self.sampler, self.after, self.calls = sampler, after, 0

    def __call__(self, logits, batch):
        if any(p.top_k == MARKED_TOP_K for p in batch.params):
            self.calls += 1
            if self.calls >= self.after:
                raise RuntimeError("injected")
        return self.sampler(logits, batch)

    def __getattr__(self, name):
        return getattr(self.sampler, name)


def test_a_failing_sampler_row_fails_its_request_alone(tiny_llm_factory):
    llm = tiny_llm_factory(block_size=4)
    eng = llm.engine
    want_greedy = alone(llm, PROMPTS[0], GREEDY)
    want_seeded = alone(llm, PROMPTS[2], SEEDED)
    bad = SamplingParams(temperature=1.0, top_k=MARKED_TOP_K, n=2, max_tokens=8, ignore_eos=True)
    eng.engine_core.sampler = FailingSampler(eng.engine_core.sampler, after=3)
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
    eng.engine_core.sampler = FailingSampler(eng.engine_core.sampler)
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
