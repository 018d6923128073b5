"""``max_tokens=None`` ("all the room", the server's chat default) on a KV pool smaller than
``max_model_len``: the room is also what the pool can hold, so the request runs to the pool's
limit instead of being refused; an explicit ``max_tokens`` keeps the pool's 400.

Found by the breaker pass: ``pagedllm serve --num-kv-blocks 32`` (512 tokens, max_model_len 8192)
answered every chat request without ``max_tokens`` with 400 "a sample of up to 8192 tokens needs
more KV blocks than the whole pool"; so did ``--model gemma-3-270m`` on the default 1 GiB pool for
``max_tokens: null`` (32768 positions, ~29k tokens of KV).
"""

from __future__ import annotations

import pytest

from pagedllm.config import EngineConfig
from pagedllm.core.kv_manager import ContextLengthExceededError
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams

BLOCKS, BLOCK = 4, 16  # a pool of 64 tokens under max_model_len 256


@pytest.fixture(scope="module")
def engine(tiny_loaded):
    cfg = EngineConfig(
        max_model_len=256,
        num_gpu_blocks_override=BLOCKS,
        block_size=BLOCK,
        check_invariants=True,
        num_threads=1,
    )
    return LLMEngine(cfg, loaded=tiny_loaded)


def test_all_the_room_is_cut_to_the_pool(engine):
    prompt = [5] * 10
    assert engine.validate_request(prompt, SamplingParams(max_tokens=None)) == BLOCKS * BLOCK - 10
    # n samples share the prompt; each one alone must fit at its longest, as before.
    two = SamplingParams(max_tokens=None, n=2, temperature=1, seed=1)
    assert engine.validate_request(prompt, two) == BLOCKS * BLOCK - 10
    # Beams must all fit at their longest: the room is the largest m the pool accepts.
    beams = SamplingParams(max_tokens=None, use_beam_search=True, best_of=3)
    m = engine.validate_request(prompt, beams)
    engine.input_processor.kv.check_request_fits(10, m, 3, True)
    with pytest.raises(ContextLengthExceededError):
        engine.input_processor.kv.check_request_fits(10, m + 1, 3, True)


def test_explicit_max_tokens_over_the_pool_is_still_refused(engine):
    with pytest.raises(ContextLengthExceededError) as e:
        engine.validate_request([5] * 10, SamplingParams(max_tokens=100))
    assert e.value.param == "max_tokens"
    # A prompt that leaves the pool no room for one token is refused whatever max_tokens says.
    with pytest.raises(ContextLengthExceededError):
        engine.validate_request([5] * (BLOCKS * BLOCK), SamplingParams(max_tokens=None))


def test_all_the_room_runs_to_the_pool_limit(engine):
    engine.add_request("r", [5] * 10, SamplingParams(max_tokens=None, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    (c,) = done["r"].outputs
    assert len(c.token_ids) == BLOCKS * BLOCK - 10 and c.finish_reason == "length"
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
