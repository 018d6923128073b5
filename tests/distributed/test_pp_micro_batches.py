"""Micro-batches under pipeline parallelism: how a step is split, and greedy tokens (and prompt
logprobs, which come back per micro-batch) equal one rank's when several micro-batches per step
meet mixed prefill / decode steps, chunked prefill and preemption."""

import pytest
import torch

from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.pipeline_stage import split_micro_batches
from tests.distributed.tp_utils import child_pids, small_llm, tiny_variant

LENGTHS = (3, 11, 29, 50, 7, 19)


def test_split_micro_batches_balances_tokens_contiguously():
    # 4 decodes then prefills of 10 and 20 tokens: cuts nearest 1/3 and 2/3 of the 34 tokens.
    assert split_micro_batches([1, 1, 1, 1, 10, 20], 3) == [range(0, 4), range(4, 5), range(5, 6)]
    assert split_micro_batches([1] * 8, 2) == [range(0, 4), range(4, 8)]
    assert split_micro_batches([1] * 7, 3) == [range(0, 2), range(2, 5), range(5, 7)]
    # One long prefill first: every later micro-batch still gets a sequence.
    assert split_micro_batches([100, 1, 1], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    # Fewer sequences than micro-batches: one each.
    assert split_micro_batches([5, 6], 4) == [range(0, 1), range(1, 2)]
    assert split_micro_batches([5, 6], 1) == [range(0, 2)]
    with pytest.raises(ValueError, match="pipeline_micro_batches"):
        split_micro_batches([1, 2], 0)


def _run(llm, prompts):
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=1 if i < 2 else None
        )
        for i in range(len(prompts))
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    prompt_lps = [
        [None if pos is None else {t: lp.logprob for t, lp in pos.items()} for pos in o.prompt_logprobs]
        for o in outs[:2]
    ]
    return tokens, prompt_lps


@pytest.mark.slow  # ~60 s on 2 shared cores: two engines, one of them two processes
def test_pp_micro_batches_equal_one_rank_with_chunking_and_preemption(tiny_loaded):
    loaded = tiny_variant(tiny_loaded, num_attention_heads=4, num_key_value_heads=2)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, loaded.config.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
    ref_tokens, ref_lps = _run(small_llm(loaded), prompts)
    before = child_pids()
    # 3 micro-batches per step; a 24-token step budget chunks the 29- and 50-token prompts and
    # mixes their chunks with decodes; 16 blocks of 8 tokens cannot hold all six sequences.
    llm = small_llm(
        loaded,
        pipeline_parallel_size=2,
        pipeline_micro_batches=3,
        enable_chunked_prefill=True,
        max_num_batched_tokens=24,
        block_size=8,
        num_gpu_blocks_override=16,
        enable_prefix_caching=False,
    )
    try:
        tokens, lps = _run(llm, prompts)
        assert tokens == ref_tokens
        for got, want in zip(lps, ref_lps, strict=True):
            assert got[0] is None and want[0] is None
            for g_pos, w_pos in zip(got[1:], want[1:], strict=True):
                assert g_pos.keys() == w_pos.keys()
                assert [g_pos[t] for t in g_pos] == pytest.approx([w_pos[t] for t in g_pos], abs=1e-4)
        assert llm.engine.stats.num_preemptions > 0
        stats = llm.engine.executor.driver_worker.runner.pipeline_stats
        # Most steps ran 3 micro-batches (fewer only when fewer than 3 sequences were scheduled).
        assert stats.steps < stats.micro_batches <= 3 * stats.steps
        assert len(stats.busy_s) == 2 and all(b > 0 for b in stats.busy_s)
    finally:
        llm.engine.shutdown()
    assert child_pids() <= before
