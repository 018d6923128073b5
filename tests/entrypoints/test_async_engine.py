"""AsyncLLMEngine on the tiny random Llama: outputs, cancellation, step failures, shutdown."""

from __future__ import annotations

import asyncio

import pytest

from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineStepError
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from tests.entrypoints.server_utils import wait_idle


@pytest.fixture
def engine(tiny_loaded):
    cfg = EngineConfig(
        max_model_len=128, kv_cache_memory=1 << 21, check_invariants=True, num_threads=1
    )
    return LLMEngine(cfg, loaded=tiny_loaded)


def run(coro):
    return asyncio.run(coro)


def test_generate_concurrent_and_cancel(engine):
    async def main():
        ae = AsyncLLMEngine(engine)
        ae.start()
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

        async def collect(rid, prompt):
            last = None
            async for out in ae.generate(rid, prompt, params):
                assert last is None or out.outputs[0].text.startswith(last.outputs[0].text)
                last = out
            return last

        outs = await asyncio.gather(*(collect(f"r{i}", f"hello {i}") for i in range(6)))
        assert all(o.finished and len(o.outputs[0].token_ids) == 12 for o in outs)
        alone = await collect("again", "hello 3")
        assert alone.outputs[0].token_ids == outs[3].outputs[0].token_ids

        # a consumer cancelled mid-way aborts its request
        long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

        async def consume():
            async for _ in ae.generate("long", "hello", long):
                await asyncio.sleep(0)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.to_thread(wait_idle, engine)

        with pytest.raises(ValueError, match="^prompt"):
            await ae.add_request("bad", [], params)
        ae.shutdown()
        with pytest.raises(EngineDeadError):
            await ae.add_request("late", "hello", params)

    run(main())


def test_step_failure_fails_requests_and_engine_survives(engine):
    async def main():
        ae = AsyncLLMEngine(engine)
        ae.start()
        real = engine.step
        engine.step = lambda: (_ for _ in ()).throw(RuntimeError("injected"))
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        with pytest.raises(EngineStepError, match="injected"):
            async for _ in ae.generate("a", "hello", params):
                pass
        del engine.step
        assert engine.step == real
        assert not ae.is_dead
        outs = [o async for o in ae.generate("b", "hello", params)]
        assert outs[-1].finished
        ae.shutdown()

    run(main())


def test_from_factory_builds_and_steps_on_one_thread(tiny_loaded):
    """from_factory builds the engine on the thread that later steps it (one OpenMP team), gives
    the same greedy tokens as an engine built in the caller's thread, re-raises a failed build in
    the caller, and a shutdown before start() releases the waiting thread."""
    import threading

    cfg = dict(max_model_len=128, kv_cache_memory=1 << 21, check_invariants=True, num_threads=1)
    threads: dict[str, int] = {}

    def factory() -> LLMEngine:
        threads["built"] = threading.get_ident()
        eng = LLMEngine(EngineConfig(**cfg), loaded=tiny_loaded)
        real_step = eng.step

        def step():
            threads["stepped"] = threading.get_ident()
            return real_step()

        eng.step = step
        return eng

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def generate(ae: AsyncLLMEngine) -> list[int]:
        ae.start()
        last = None
        async for out in ae.generate("r", "hello world", params):
            last = out
        ae.shutdown()
        assert last is not None and last.finished
        return list(last.outputs[0].token_ids)

    built = AsyncLLMEngine.from_factory(factory)
    assert "built" in threads and threads["built"] != threading.get_ident()
    tokens = run(generate(built))
    assert threads["stepped"] == threads["built"]
    plain = run(generate(AsyncLLMEngine(LLMEngine(EngineConfig(**cfg), loaded=tiny_loaded))))
    assert tokens == plain and len(tokens) == 8

    def broken() -> LLMEngine:
        raise ValueError("max_model_len: broken on purpose")

    with pytest.raises(ValueError, match="broken on purpose"):
        AsyncLLMEngine.from_factory(broken)

    idle = AsyncLLMEngine.from_factory(factory)
    thread = idle._prestarted[0]
    idle.shutdown()
    thread.join(5)
    assert not thread.is_alive()


def test_public_interface_and_published_counters(engine):
    """What the server reads: facts copied at construction, counters published by the engine
    thread (equal to the live engine's once idle), KV captures on the engine thread."""

    async def main():
        ae = AsyncLLMEngine(engine)
        assert ae.tokenizer is not engine.tokenizer  # the event loop's own copy
        assert ae.tokenizer("hello").input_ids == engine.tokenizer("hello").input_ids
        assert (ae.max_model_len, ae.vocab_size) == (128, engine.vocab_size)
        assert ae.model == engine.config.model
        params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
        assert ae.validate_request([1, 2, 3], params) == 7
        with pytest.raises(ValueError, match="^max_tokens"):
            ae.validate_request([1] * 100, SamplingParams(max_tokens=50))
        before = ae.counters
        assert before.stats.generation_tokens == 0 and before.num_unfinished_requests == 0
        assert before.num_free_blocks == before.num_blocks == engine.block_manager.num_blocks

        ae.start()
        outs = [o async for o in ae.generate("r", "hello world", params)]
        assert len(outs[-1].outputs[0].token_ids) == 7
        # published after the finishing step, before its output reached this loop
        c = ae.counters
        assert c.stats.generation_tokens == engine.stats.generation_tokens >= 7
        assert c.stats.num_steps == engine.stats.num_steps >= 7
        assert c.block_size == engine.block_manager.block_size
        assert c is not before and c.monotonic > before.monotonic

        raw = await ae.capture_kv()
        assert raw["num_blocks"] == c.num_blocks and raw["stats"][0] == c.stats.num_steps
        ae.shutdown()
        assert ae.counters.num_unfinished_requests == 0
        assert ae.counters.num_free_blocks == ae.counters.num_blocks
        assert (await ae.capture_kv())["num_blocks"] == c.num_blocks  # stopped: taken directly

    run(main())


def test_a_failing_request_fails_alone(engine):
    """A request whose own part of a step raises gets an EngineStepError; the request running
    beside it finishes normally and the engine is not dead."""

    async def main():
        ae = AsyncLLMEngine(engine)
        ae.start()
        greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        beam = SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0, max_tokens=6,
                              ignore_eos=True, length_penalty=1.0)
        real_add = engine.add_request

        def add_request(request_id, *args, **kwargs):
            real_add(request_id, *args, **kwargs)
            if request_id == "beam":
                group = engine.engine_core.requests["beam"]
                group.beam.step = lambda *a: (_ for _ in ()).throw(OverflowError("injected"))

        engine.add_request = add_request

        async def consume(rid, params):
            return [o async for o in ae.generate(rid, "hello", params)][-1]

        ok, bad = await asyncio.gather(
            consume("greedy", greedy), consume("beam", beam), return_exceptions=True
        )
        assert isinstance(bad, EngineStepError) and "injected" in str(bad)
        assert ok.finished and len(ok.outputs[0].token_ids) == 6
        assert not ae.is_dead and ae.num_step_errors == 0
        ae.shutdown()

    run(main())
