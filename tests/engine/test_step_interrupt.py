"""``interrupt_decode_for_prefill`` (``model.step_interrupt``): a step stopped between decoder
layers is discarded whole and run again, so greedy tokens, logprobs and the KV pool end as if it
had never started; the run again of a stopped step cannot itself be stopped."""

from __future__ import annotations

import random
import threading
import time

import pytest

from pagedllm.entrypoints.llm import LLM
from pagedllm.model.step_interrupt import StepInterrupt
from pagedllm.ops import load_cpu_ops
from pagedllm.sampling_params import SamplingParams

_OPS = load_cpu_ops()
pytestmark = [
    pytest.mark.skipif(_OPS is None, reason="needs the C++ CPU kernels"),
    # Steps stop between the layers of the fused decoder op, which runs fp32 weights only on the
    # own GEMM (avx2 variant); the avx512 variant's fp32 linears are oneDNN's (left unfused).
    pytest.mark.skipif(
        _OPS is not None and _OPS.simd_level() != "avx2",
        reason="fp32 layers fuse (and so stop) only on the avx2 kernel variant's own GEMM; "
        f"this CPU runs {_OPS.simd_level() if _OPS else None!r}",
    ),
]

PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11, 64], [9, 8, 7, 6], [150, 151, 152, 153, 154, 155]]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


class StopBeforeFirstLayer(StepInterrupt):
    """Asks the steps numbered in ``steps`` (1-based, counting every forward pass) to stop
    before their first layer: deterministic stops."""

    def __init__(self, steps: set[int]) -> None:
        super().__init__()
        self.steps = steps
        self.passes = 0

    def clear(self) -> None:
        super().clear()
        self.passes += 1
        if self.passes in self.steps:
            self.request()


def install(llm: LLM, interrupt: StepInterrupt) -> None:
    llm.engine.executor.worker.model.step_interrupt = interrupt
    llm.engine.engine_core.step_interrupt = interrupt


def run(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [
        (
            o.outputs[0].token_ids,
            [{t: x.logprob for t, x in d.items()} for d in o.outputs[0].logprobs],
        )
        for o in outs
    ]


def test_the_option_shares_one_flag_between_model_and_engine(tiny_llm_factory) -> None:  # noqa: ANN001
    llm = tiny_llm_factory(interrupt_decode_for_prefill=True)
    interrupt = llm.engine.engine_core.step_interrupt
    assert isinstance(interrupt, StepInterrupt)
    assert llm.engine.executor.worker.model.step_interrupt is interrupt
    assert tiny_llm_factory().engine.engine_core.step_interrupt is None  # off by default


def test_stopped_steps_leave_no_trace(tiny_llm_factory) -> None:  # noqa: ANN001
    """The prefill step, a decode step and two steps in a row stop before their first layer:
    tokens and logprobs equal the run without stops, 4 steps were discarded and every step
    after a discarded one is marked not stoppable; the factory checks the pool is empty."""
    reference = run(tiny_llm_factory())
    llm = tiny_llm_factory(interrupt_decode_for_prefill=True)
    interrupt = StopBeforeFirstLayer({1, 4, 7, 8})
    install(llm, interrupt)
    core = llm.engine.engine_core
    stoppable: list[bool] = []
    execute = llm.engine.executor.execute_model

    def recording(sched):  # noqa: ANN001, ANN202
        stoppable.append(core.step_in_flight[1])
        return execute(sched)

    llm.engine.executor.execute_model = recording
    assert run(llm) == reference
    assert llm.engine.stats.num_interrupted_steps == 4
    assert stoppable[1] is False and stoppable[4] is False and stoppable[7] is False  # reruns
    assert stoppable[8] is False  # the rerun after the second stop in a row
    assert stoppable[2] is True  # a plain decode step


@pytest.mark.slow
def test_stops_between_layers_from_another_thread(smollm) -> None:  # noqa: ANN001
    """SmolLM2-135M (30 layers, milliseconds per step): a thread asks every other step to stop
    after a random 0-1 ms, so most stops land between two layers after some K/V was written;
    greedy tokens and logprobs equal the run without stops, no block is left allocated."""
    llm = LLM(loaded=smollm, num_threads=1, max_model_len=128, check_invariants=True)
    reference = run(llm)
    llm = LLM(
        loaded=smollm,
        num_threads=1,
        max_model_len=128,
        check_invariants=True,
        interrupt_decode_for_prefill=True,
    )
    core, interrupt = llm.engine.engine_core, llm.engine.engine_core.step_interrupt
    done = threading.Event()
    rng = random.Random(0)

    def poke() -> None:
        seen = None
        while not done.is_set():
            in_flight = core.step_in_flight
            if in_flight is not None and in_flight is not seen:
                seen = in_flight
                if in_flight[1]:
                    time.sleep(rng.uniform(0, 0.001))
                    interrupt.request()
            time.sleep(0.0002)

    stopper = threading.Thread(target=poke)
    stopper.start()
    try:
        assert run(llm) == reference
    finally:
        done.set()
        stopper.join()
    assert llm.engine.stats.num_interrupted_steps >= 1
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
