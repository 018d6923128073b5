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


def test_tp2_bfloat16_runs_the_own_gemm_and_speculation_keeps_its_tokens(tiny_loaded):
    """In bfloat16 the row-parallel projections and the LM head shard are packed for the own
    GEMM (float32 partial sums, every row on its own), so tp = 2 with n-gram speculation emits
    the tokens tp = 2 emits without it. Before, those layers ran ATen's bfloat16 matmul, whose
    bits depend on the row count (a new user saw greedy output differ under tp 3)."""
    import pytest

    from pagedllm.model.layers.parallel import PackedRowParallelLinear
    from pagedllm.model.packed_linear import PackedLinear, own_gemm_runs

    if not own_gemm_runs(torch.bfloat16):
        pytest.skip("the own GEMM runs bfloat16 only on CPUs with avx512_bf16 (this CPU lacks "
                    "it in /proc/cpuinfo, or the C++ kernels are off)")
    loaded = tiny_variant(tiny_loaded, num_attention_heads=4, num_key_value_heads=2)
    prompts = repetitive_prompts(loaded.config.vocab_size)
    kw = dict(tensor_parallel_size=2, distributed_executor_backend="mp", dtype="bfloat16")
    off = small_llm(loaded, **kw)
    try:
        model = off.engine.executor.driver_worker.model  # rank 0, in this process
        layer = model.layers[0]
        assert type(layer.self_attn.o_proj) is PackedRowParallelLinear
        assert type(layer.mlp.down_proj) is PackedRowParallelLinear
        assert type(model.lm_head_packed) is PackedLinear  # the rank's vocabulary shard
        ref = greedy_tokens(off, prompts, max_tokens=24)
    finally:
        off.engine.shutdown()
    llm = small_llm(loaded, speculative_config=SPEC, **kw)
    try:
        assert greedy_tokens(llm, prompts, max_tokens=24) == ref
        assert llm.engine.stats.spec_accepted_tokens > 0
    finally:
        llm.engine.shutdown()
