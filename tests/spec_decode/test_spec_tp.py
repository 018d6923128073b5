"""Speculative decoding with tensor parallelism (issue 25): tp = 2 (multiprocessing executor,
tiny random Llama, fp32) with n-gram speculation emits the same greedy tokens as tp = 1
without it, so the ``k + 1`` verification rows of every sequence travel to the workers and
come back in order, and the rolled-back slots are rewritten correctly by both ranks."""

import torch

from tests.distributed.tp_utils import child_pids, greedy_tokens, small_llm, tiny_variant

# learn_step_cost off: the test counts drafts, which a timing-learned policy may cut.
SPEC = ('{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 64, '
        '"learn_step_cost": false}')


def repetitive_prompts(vocab_size: int) -> list[list[int]]:
    """Prompts that repeat a phrase (n-gram lookups find matches), plus one random prompt."""
    g = torch.Generator().manual_seed(11)
    phrase = [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in (5, 7, 3)]
    return [phrase[0] * 6, phrase[1] * 4 + phrase[2], phrase[2] * 9,
            torch.randint(0, vocab_size, (23,), generator=g).tolist()]


def test_tp2_with_speculation_equals_tp1_without(tiny_loaded):
    loaded = tiny_variant(tiny_loaded, num_attention_heads=4, num_key_value_heads=2)
    prompts = repetitive_prompts(loaded.config.vocab_size)
    ref = greedy_tokens(small_llm(loaded), prompts, max_tokens=24)
    before = child_pids()
    llm = small_llm(loaded, tensor_parallel_size=2, distributed_executor_backend="mp",
                    speculative_config=SPEC)
    try:
        assert llm.engine.executor.world_size == 2
        assert greedy_tokens(llm, prompts, max_tokens=24) == ref
        st = llm.engine.stats
        assert st.spec_draft_tokens > 0 and st.spec_accepted_tokens > 0  # verify rows really ran
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks  # every slot rolled back or freed
    finally:
        llm.engine.shutdown()
    assert child_pids() <= before
