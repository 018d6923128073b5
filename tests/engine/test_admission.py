"""Admission control (``pagedllm.engine.admission``): the ``slots`` rule admits only what can start
at the next step (a free batch slot of ``max_num_seqs`` and KV room for the prompt); ``queue``
bounds only the waiting queue. Deterministic: counters are built by hand, and the end-to-end test
holds the engine thread between two steps instead of racing the clock."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import pytest

from pagedllm.config import EngineConfig
from pagedllm.engine.admission import AdmissionControl, QueueFullError, request_width
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.kv_snapshot import EngineCounters, collect_counters
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams

GREEDY = {"temperature": 0, "ignore_eos": True}


def make_engine(tiny_loaded, **kw) -> LLMEngine:
    cfg = EngineConfig(
        max_model_len=128, kv_cache_memory=1 << 21, check_invariants=True, num_threads=1, **kw
    )
    return LLMEngine(cfg, loaded=tiny_loaded)


@pytest.fixture(scope="module")
def idle_counters(tiny_loaded) -> EngineCounters:
    return collect_counters(make_engine(tiny_loaded))


def sp(n: int = 1, best_of: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=2, n=n, best_of=best_of)


def test_request_width_is_n_or_best_of():
    assert [request_width(sp()), request_width(sp(3)), request_width(sp(2, 4))] == [1, 3, 4]


def test_slots_refuses_without_a_free_batch_slot(idle_counters):
    adm = AdmissionControl("slots", None, max_num_seqs=4)
    adm.admit("a", sp())
    adm.admit("b", sp(n=2))
    assert adm.live_seqs == 3
    adm.check(sp(), idle_counters, 0, 5)  # the 4th slot is free
    with pytest.raises(QueueFullError, match=r"3 of max_num_seqs 4 batch slots .* needs 2"):
        adm.check(sp(n=2), idle_counters, 0, 5)
    adm.release("b")
    adm.release("b")  # idempotent: a finished output and the consumer's close both release
    assert adm.live_seqs == 1
    adm.check(sp(best_of=3), idle_counters, 0, 5)


def test_slots_refuses_a_prompt_the_free_kv_blocks_cannot_hold(idle_counters):
    adm = AdmissionControl("slots", None, max_num_seqs=8)
    c = replace(idle_counters, block_size=16, num_free_blocks=2)
    adm.check(sp(), c, 0, 32)  # exactly 2 blocks
    with pytest.raises(QueueFullError, match=r"2 free KV blocks cannot hold a 33-token prompt"):
        adm.check(sp(), c, 0, 33)
    adm.check(sp(), c, 0, None)  # not tokenized: only the slots are checked


def test_queue_policy_counts_only_the_waiting_queue(idle_counters):
    adm = AdmissionControl("queue", 2, max_num_seqs=1)
    for rid in "abcde":  # far more live requests than batch slots: not this policy's concern
        adm.admit(rid, sp())
    adm.check(sp(), replace(idle_counters, num_waiting=1), 0, 1000)
    with pytest.raises(QueueFullError, match=r"2 requests are waiting already"):
        adm.check(sp(), replace(idle_counters, num_waiting=1), 1, 1)
    # Both limits apply under slots.
    slots = AdmissionControl("slots", 1, max_num_seqs=8)
    with pytest.raises(QueueFullError, match="max_waiting_requests"):
        slots.check(sp(), replace(idle_counters, num_waiting=1), 0, 1)


def test_unknown_admission_policy_is_a_value_error():
    with pytest.raises(ValueError, match=r"^admission"):
        AdmissionControl("lifo", None, 4)
    with pytest.raises(ValueError, match="admission"):
        EngineConfig(admission="lifo")


@pytest.mark.parametrize(
    "options,resolved",
    [
        ({}, (False, False)),
        ({"admission": "slots"}, (True, True)),
        ({"admission": "slots", "scheduling_policy": "priority"}, (False, True)),
        (
            {"admission": "slots", "prefill_first": False, "interrupt_decode_for_prefill": False},
            (False, False),
        ),
        ({"prefill_first": True, "interrupt_decode_for_prefill": True}, (True, True)),
    ],
)
def test_slots_turns_on_prefill_first_and_step_interrupts_by_default(options, resolved):
    """``prefill_first`` / ``interrupt_decode_for_prefill`` left at None follow ``admission``:
    on with ``slots`` (prefill-first only with fcfs), off with ``queue``; given values win."""
    cfg = EngineConfig(**options)
    assert (cfg.use_prefill_first, cfg.use_step_interrupt) == resolved


def test_slots_engine_schedules_prefill_first_and_warns_only_when_asked(tiny_loaded, caplog):
    """The engine follows the resolved values; where a step cannot be stopped (speculative
    decoding) the default stays quiet, while asking for the option explicitly warns."""
    engine = make_engine(tiny_loaded, admission="slots")
    assert engine.scheduler.config.prefill_first is True
    assert make_engine(tiny_loaded).scheduler.config.prefill_first is False
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    with caplog.at_level("WARNING", logger="pagedllm"):
        quiet = make_engine(tiny_loaded, admission="slots", speculative_config=spec)
    assert quiet.engine_core.step_interrupt is None
    assert "interrupt_decode_for_prefill is ignored" not in caplog.text
    with caplog.at_level("WARNING", logger="pagedllm"):
        make_engine(tiny_loaded, interrupt_decode_for_prefill=True, speculative_config=spec)
    assert "interrupt_decode_for_prefill is ignored" in caplog.text


def test_async_engine_admits_only_into_free_slots(tiny_loaded):
    eng = make_engine(tiny_loaded, max_num_seqs=2, admission="slots")
    prompt = [1, 2, 3, 4, 5]

    async def main() -> None:
        ae = AsyncLLMEngine(eng, log_stats_interval=0)
        ae.start()
        release = threading.Event()
        ae.call_in_engine_thread(lambda _: release.wait(60))  # hold the thread between steps
        params = SamplingParams(max_tokens=3, **GREEDY)
        adds = [asyncio.create_task(ae.add_request(r, prompt, params)) for r in ("a", "b")]
        await asyncio.sleep(0)  # both adds queued for the held thread: both slots taken
        with pytest.raises(QueueFullError, match="max_num_seqs 2"):
            await ae.add_request("c", prompt, params)
        release.set()
        streams = [await t for t in adds]
        outs_a = [o async for o in streams[0]]
        assert outs_a[-1].finished
        # a's finished output freed its slot: c is admitted although b may still run.
        outs_c = [o async for o in await ae.add_request("c", prompt, params)]
        outs_b = [o async for o in streams[1]]
        tokens = [o[-1].outputs[0].token_ids for o in (outs_a, outs_b, outs_c)]
        assert tokens[0] == tokens[1] == tokens[2] and len(tokens[0]) == 3
        assert ae._admission.live_seqs == 0
        ae.shutdown()

    asyncio.run(main())
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
