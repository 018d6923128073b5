"""Pipeline parallelism (multi-process executor, one host) on tiny random Llamas: greedy tokens
equal the single-rank engine's for pp = 2 and tp = 2 x pp = 2; each stage holds only its
layers' weights and KV caches; per-stage idle shares are recorded."""

import pytest
import torch

from pagedllm.distributed import max_stage_layers, stage_layer_range
from pagedllm.entrypoints.llm import LLM
from tests.distributed.tp_utils import child_pids, greedy_tokens, small_llm, tiny_variant

LENGTHS = (3, 11, 29, 50)


def prompts_for(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in LENGTHS]


def make_llm(loaded, tp=1, pp=1):
    return small_llm(loaded, tensor_parallel_size=tp, pipeline_parallel_size=pp)


def test_stage_layer_ranges():
    assert [stage_layer_range(5, s, 2) for s in range(2)] == [range(0, 3), range(3, 5)]
    assert [stage_layer_range(4, s, 3) for s in range(3)] == [range(0, 2), range(2, 3), range(3, 4)]
    assert max_stage_layers(5, 2) == 3
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        stage_layer_range(2, 0, 3)


def test_pp_rejects_uni_backend(tiny_loaded):
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        LLM(loaded=tiny_loaded, pipeline_parallel_size=2, distributed_executor_backend="uni")


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2)], ids=["pp2", "tp2-pp2"])
def test_pp_greedy_equals_one_rank(tiny_loaded, tp, pp):
    loaded = tiny_variant(tiny_loaded, num_attention_heads=4, num_key_value_heads=2)
    prompts = prompts_for(loaded.config.vocab_size)
    ref = greedy_tokens(make_llm(loaded), prompts)
    before = child_pids()
    llm = make_llm(loaded, tp, pp)
    try:
        executor = llm.engine.executor
        assert executor.world_size == tp * pp
        driver = executor.driver_worker
        layers = loaded.config.num_hidden_layers
        # The driver (stage 0) holds only stage 0's layers and their KV caches.
        assert driver.model.stage_layers == stage_layer_range(layers, 0, pp)
        assert len(driver.cache.kv_caches) == len(stage_layer_range(layers, 0, pp))
        assert greedy_tokens(llm, prompts) == ref
        stats = driver.runner.pipeline_stats
        assert stats.steps > 0 and len(stats.busy_s) == pp
        # Default: pp micro-batches per step (a step of one sequence cannot be split).
        assert stats.steps < stats.micro_batches <= pp * stats.steps
        assert all(b > 0 for b in stats.busy_s)
        assert all(0.0 <= s <= 1.0 for s in stats.idle_share())
    finally:
        llm.engine.shutdown()
    assert child_pids() <= before
