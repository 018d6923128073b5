"""Tensor parallelism with the Ray executor (a local ``ray.init(num_cpus=...)`` instance): greedy
tokens equal the tp = 1 engine's; shutdown leaves no actor behind."""

import time

import pytest

from tests.distributed.test_tp_engine import make_llm, prompts_for
from tests.distributed.tp_utils import greedy_tokens, tiny_variant

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.slow  # a local Ray instance and its actors take ~1 min to start here


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_tp2_greedy_equals_tp1(tiny_loaded, local_ray):
    loaded = tiny_variant(tiny_loaded, num_attention_heads=4, num_key_value_heads=2)
    prompts = prompts_for(loaded.config.vocab_size)
    ref = greedy_tokens(make_llm(loaded, 1), prompts)
    llm = make_llm(loaded, 2, backend="ray")
    pids = list(llm.engine.executor.pids)
    try:
        assert llm.engine.executor.world_size == 2
        assert greedy_tokens(llm, prompts) == ref
        assert llm.engine.executor.last_message_bytes > 0
    finally:
        llm.engine.shutdown()
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(
        psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids
    ), "a Ray actor outlived the engine"


def test_ray_killed_actor_fails_fast(tiny_loaded, local_ray):
    import os
    import signal
    import threading

    from pagedllm.executor.base import WorkerDiedError
    from pagedllm.sampling_params import SamplingParams

    loaded = tiny_variant(tiny_loaded, num_attention_heads=4, num_key_value_heads=2)
    llm = make_llm(loaded, 2, backend="ray", max_model_len=512, num_gpu_blocks_override=256)
    engine = llm.engine
    pid = engine.executor.pids[0]
    for i, p in enumerate(prompts_for(loaded.config.vocab_size) * 4):
        engine.add_request(
            str(i), p, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        )
    for _ in range(3):
        engine.step()
    threading.Timer(0.05, os.kill, args=(pid, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError) as info:
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - t0 < 10
    assert info.value.rank == 1
    engine.shutdown()
