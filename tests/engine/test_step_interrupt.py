"""``interrupt_decode_for_prefill`` (``model.step_interrupt``): a step stopped between decoder
layers is discarded whole and run again, so greedy tokens, logprobs and the KV pool end as if it
had never started; the run again of a stopped step cannot itself be stopped."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from pagedllm.entrypoints.llm import LLM
from pagedllm.model.packed_linear import cpu_gemm_ops
from pagedllm.model.step_interrupt import StepInterrupt
from pagedllm.ops import load_cpu_ops
from pagedllm.sampling_params import SamplingParams

_OPS = load_cpu_ops()
pytestmark = [
    pytest.mark.skipif(_OPS is None, reason="needs the C++ CPU kernels"),
    # Steps stop between the layers of the fused decoder op, which runs fp32 weights only on the
    # own GEMM (avx2 and avx512 variants; the scalar one's fp32 linears are oneDNN's, unfused).
    pytest.mark.skipif(
        _OPS is not None and cpu_gemm_ops(_OPS, torch.float32) is None,
        reason="fp32 layers fuse (and so stop) only on the own GEMM (avx2 / avx512 variants); "
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


PREEMPT_PROMPTS = [list(range(10, 42)) + list(range(100 + 8 * i, 108 + 8 * i)) for i in range(4)]
PREEMPT_CASES = {
    "n3": SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=30, ignore_eos=True),
    "beam": SamplingParams(
        n=2, best_of=3, use_beam_search=True, temperature=0, max_tokens=20, ignore_eos=True
    ),
    "greedy_logprobs": SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2),
}


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("case", list(PREEMPT_CASES))
def test_stopped_steps_with_forks_beams_preemption_and_cached_prefixes(
    tiny_llm_factory, case, mode
) -> None:  # noqa: ANN001
    """Every third forward pass stops in a 12-block pool where four 40-token prompts sharing
    their first 32 tokens (prefix cache hits) are preempted, fork their prompt blocks (n = 3,
    beams: copy on write when a shared last block grows) and swap: the scheduler's work for a
    stopped step (new blocks, copies, swaps, preemptions) is kept and the step's forward pass
    run again, so every output equals the run without stops; the factory checks the pool."""
    kw = dict(block_size=16, num_gpu_blocks_override=12, max_model_len=96, preemption_mode=mode)

    def outputs(llm: LLM) -> list:
        outs = llm.generate(PREEMPT_PROMPTS, PREEMPT_CASES[case], use_tqdm=False)
        return [
            [(c.token_ids, c.cumulative_logprob, c.logprobs and [sorted(d) for d in c.logprobs])
             for c in o.outputs]
            for o in outs
        ]  # fmt: skip

    reference = outputs(tiny_llm_factory(**kw))
    llm = tiny_llm_factory(interrupt_decode_for_prefill=True, **kw)
    install(llm, StopBeforeFirstLayer(set(range(2, 400, 3))))
    assert outputs(llm) == reference
    assert llm.engine.stats.num_interrupted_steps > 5
    assert llm.engine.scheduler.num_preemptions > 0


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
