"""Beam search through the engine (block tree: fork kept beams, free dropped ones) equals
transformers' beam search on the same weights."""

import pytest
import torch

PROMPTS = ["hello world", "the quick brown fox jumps", "a block table maps logical blocks"]


def hf_beams(hf, ids, width, max_tokens, lp, es, n, eos):
    out = hf.generate(
        torch.tensor([ids]), num_beams=width, num_return_sequences=n, max_new_tokens=max_tokens,
        length_penalty=lp, early_stopping=es, do_sample=False, eos_token_id=eos, pad_token_id=eos,
        output_scores=True, return_dict_in_generate=True,
    )
    seqs = []
    for row in out.sequences[:, len(ids):].tolist():
        if eos in row:
            row = row[: row.index(eos) + 1]
        seqs.append(row)
    return seqs, out.sequences_scores.tolist()


@pytest.mark.parametrize("width,lp,es", [(2, 1.0, False), (3, 0.5, True), (4, 2.0, "never")])
def test_beam_search_equals_transformers(tiny_llm_factory, hf_tiny_model, tiny_tokenizer, width, lp, es):
    # An EOS the model actually emits, so some beams finish early.
    ids0 = tiny_tokenizer(PROMPTS[0]).input_ids
    with torch.no_grad():
        eos = int(hf_tiny_model(torch.tensor([ids0])).logits[0, -1].topk(2).indices[1])
    llm = tiny_llm_factory(block_size=4)
    llm.engine.eos_token_ids = [eos]
    for p in PROMPTS:
        ids = tiny_tokenizer(p).input_ids
        ref_seqs, ref_scores = hf_beams(hf_tiny_model, ids, width, 12, lp, es, width, eos)
        out = llm.beam_search(p, beam_width=width, max_tokens=12, length_penalty=lp,
                              early_stopping=es, use_tqdm=False)[0]
        assert [c.token_ids for c in out.outputs] == ref_seqs
        for c, score in zip(out.outputs, ref_scores):
            assert abs(c.cumulative_logprob / len(c.token_ids) ** lp - score) < 1e-4
        assert out.finished


def test_beam_blocks_form_a_tree_and_are_freed(tiny_llm_factory, tiny_tokenizer):
    llm = tiny_llm_factory(block_size=2)
    eng = llm.engine
    from pagedllm.sampling_params import SamplingParams

    eng.add_request("b", PROMPTS[2], SamplingParams(n=2, best_of=4, use_beam_search=True, temperature=0,
                                                   max_tokens=10, ignore_eos=True))
    shared_seen = False
    while eng.has_unfinished_requests():
        eng.step()
        group = eng.requests.get("b")
        if group and len(group.seqs) > 1:
            rc = eng.block_manager.allocator.ref_counts
            first = eng.block_manager.get_block_table(group.seqs[0])[0]
            shared_seen |= rc[first] == len(group.seqs)  # the prompt's first block: one copy
    assert shared_seen
    assert eng.block_manager.num_free_blocks == eng.num_blocks


def test_a_failing_beam_step_aborts_only_its_request(tiny_llm_factory):
    """An exception in one request's beam step (as length_penalty 1000's OverflowError was)
    aborts that request alone: the greedy request beside it finishes with the tokens it gets
    alone, the failed one comes out finished "abort" with the exception in its output's ``error``,
    and every block is free."""
    from pagedllm.sampling_params import SamplingParams

    llm = tiny_llm_factory(block_size=4)
    eng = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0].token_ids
    eng.add_request("beam", PROMPTS[1], SamplingParams(n=2, best_of=3, use_beam_search=True,
                                                      temperature=0, max_tokens=8, ignore_eos=True))
    eng.add_request("greedy", PROMPTS[0], greedy)
    calls = {"n": 0}
    beam = eng.engine_core.requests["beam"].beam
    real_step = beam.step

    def failing_step(logprobs, beams):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OverflowError("injected")
        return real_step(logprobs, beams)

    beam.step = failing_step
    finished = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
    assert calls["n"] == 3
    assert finished["greedy"].outputs[0].token_ids == alone
    assert [c.finish_reason for c in finished["beam"].outputs] == ["abort", "abort"]
    assert finished["beam"].error == "OverflowError: injected"
    assert finished["greedy"].error is None
    assert eng.block_manager.num_free_blocks == eng.num_blocks


def test_beam_logprobs_equal_transformers_transition_scores(
    tiny_llm_factory, hf_tiny_model, tiny_tokenizer
):
    """Each returned beam's per-token logprobs are transformers' transition scores of that
    beam (they sum to its cumulative logprob), with the request's top-k alternatives ranked;
    prompt logprobs come as for sampling (both were refused with beam search)."""
    from pagedllm.sampling_params import SamplingParams

    ids0 = tiny_tokenizer(PROMPTS[0]).input_ids
    with torch.no_grad():
        eos = int(hf_tiny_model(torch.tensor([ids0])).logits[0, -1].topk(2).indices[1])
    llm = tiny_llm_factory(block_size=4)
    llm.engine.eos_token_ids = [eos]
    width = 3
    for p in PROMPTS:
        ids = tiny_tokenizer(p).input_ids
        ref = hf_tiny_model.generate(
            torch.tensor([ids]), num_beams=width, num_return_sequences=width, max_new_tokens=10,
            do_sample=False, eos_token_id=eos, pad_token_id=eos, output_scores=True,
            return_dict_in_generate=True,
        )
        trans = hf_tiny_model.compute_transition_scores(
            ref.sequences, ref.scores, ref.beam_indices, normalize_logits=False
        )
        sp = SamplingParams(use_beam_search=True, n=width, best_of=width, max_tokens=10,
                            temperature=0, logprobs=2, prompt_logprobs=1)
        out = llm.generate(p, sp, use_tqdm=False)[0]
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
        for c, row in zip(out.outputs, trans.tolist(), strict=True):
            assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
            got = [entry[t].logprob for entry, t in zip(c.logprobs, c.token_ids, strict=True)]
            assert got == pytest.approx(row[: len(got)], abs=1e-4)
            assert sum(got) == pytest.approx(c.cumulative_logprob, abs=1e-4)
            for entry, t in zip(c.logprobs, c.token_ids, strict=True):
                by_rank = {lp.rank: lp.logprob for lp in entry.values()}
                assert by_rank[1] >= by_rank[2] and entry[t].logprob <= by_rank[1]
                assert by_rank[entry[t].rank] == entry[t].logprob


def test_a_beam_search_capped_by_the_pool_finishes_and_frees_its_blocks(tiny_llm_factory):
    """Two beams fill a 17-block pool (61 prompt tokens + 3, block size 4): when the scheduler
    caps the search by length for lack of blocks, it finishes with its live beams as the
    hypotheses ("length") and gives every block back. It used to stay running forever, holding
    16 of the 17 blocks, so later requests waited for good (a fresh user found it)."""
    from pagedllm.sampling_params import SamplingParams

    llm = tiny_llm_factory(block_size=4, num_gpu_blocks_override=17)
    sp = SamplingParams(n=2, use_beam_search=True, max_tokens=3, temperature=0)
    out = llm.generate([[5 + i % 50 for i in range(61)]], sp, use_tqdm=False)[0]
    assert out.finished and len(out.outputs) == 2
    assert all(c.finish_reason == "length" and 1 <= len(c.token_ids) <= 3 for c in out.outputs)
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # the pool serves the next request
    assert llm.generate([[7] * 8], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
