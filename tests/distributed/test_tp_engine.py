"""Tensor-parallel engine (multi-process executor) on tiny random Llamas: greedy tokens equal the
tp = 1 engine's; a killed worker fails the engine fast; nothing outlives the engine."""

import os
import signal
import threading
import time

import pytest
import torch

from pagedllm.executor.base import WorkerDiedError
from tests.distributed.tp_utils import child_pids, greedy_tokens, small_llm, tiny_variant

LENGTHS = (3, 11, 29, 50)


def prompts_for(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in LENGTHS]


def make_llm(loaded, tp, backend=None, **kw):
    return small_llm(loaded, tensor_parallel_size=tp, distributed_executor_backend=backend, **kw)


@pytest.mark.parametrize(
    "shape",
    [
        dict(num_attention_heads=4, num_key_value_heads=2),  # KV heads split over 2 ranks
        dict(num_attention_heads=4, num_key_value_heads=1),  # KV head replicated on 2 ranks
    ],
    ids=["kv-split", "kv-replicated"],
)
def test_tp2_greedy_equals_tp1(tiny_loaded, shape):
    loaded = tiny_variant(tiny_loaded, **shape)
    prompts = prompts_for(loaded.config.vocab_size)
    ref = greedy_tokens(make_llm(loaded, 1), prompts)
    before = child_pids()
    llm = make_llm(loaded, 2)
    try:
        assert llm.engine.executor.world_size == 2
        assert greedy_tokens(llm, prompts) == ref
        assert all(len(t) == 16 for t in ref)
    finally:
        llm.engine.shutdown()
    assert child_pids() <= before


def test_tp3_greedy_equals_tp1_uneven_vocab(tiny_loaded):
    # 6 query heads / 3 KV heads / SwiGLU width 96 over 3 ranks; the vocabulary (~400) does not
    # divide by 3, so the last vocabulary shard is padded.
    loaded = tiny_variant(
        tiny_loaded, num_attention_heads=6, num_key_value_heads=3, intermediate_size=96
    )
    prompts = prompts_for(loaded.config.vocab_size)
    ref = greedy_tokens(make_llm(loaded, 1), prompts)
    llm = make_llm(loaded, 3)
    try:
        assert greedy_tokens(llm, prompts) == ref
        assert llm.engine.executor.last_message_bytes > 0
    finally:
        llm.engine.shutdown()


def test_killed_worker_fails_fast_and_leaves_no_process(tiny_loaded):
    loaded = tiny_variant(tiny_loaded, num_attention_heads=4, num_key_value_heads=2)
    before = child_pids()
    llm = make_llm(loaded, 2, max_model_len=512, num_gpu_blocks_override=256)
    engine = llm.engine
    victim = engine.executor._procs[0]
    assert victim.pid in child_pids()
    prompts = prompts_for(loaded.config.vocab_size) * 4
    for i, p in enumerate(prompts):
        from pagedllm.sampling_params import SamplingParams

        engine.add_request(
            str(i), p, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        )
    for _ in range(3):
        engine.step()  # generation is under way
    killer = threading.Timer(0.05, os.kill, args=(victim.pid, signal.SIGKILL))
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError) as info:
        while engine.has_unfinished_requests():
            engine.step()
    elapsed = time.monotonic() - t0
    print(f"engine raised {type(info.value).__name__} {elapsed:.2f} s after the kill was armed")
    assert elapsed < 10, elapsed
    assert info.value.rank == 1
    assert info.value.exitcode == -signal.SIGKILL
    assert "rank 1" in str(info.value)
    engine.shutdown()
    deadline = time.monotonic() + 5
    while child_pids() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not (child_pids() - before)


def test_garbage_collected_llm_leaves_no_process(tiny_loaded):
    import gc

    loaded = tiny_variant(tiny_loaded, num_attention_heads=4, num_key_value_heads=2)
    before = child_pids()
    llm = make_llm(loaded, 2)
    assert child_pids() - before
    greedy_tokens(llm, prompts_for(loaded.config.vocab_size)[:1], max_tokens=2)
    del llm
    gc.collect()
    assert not (child_pids() - before)
