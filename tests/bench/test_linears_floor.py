"""The linears-only floor of benchmarks/linears_floor.py: the step shapes it records and replays."""

import sys
from pathlib import Path

from pagedllm.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from linears_floor import StepShapes, linears_ms, workload_floor_s  # noqa: E402


def test_step_shapes_are_recorded_and_replayed(tiny_llm_factory):
    llm = tiny_llm_factory(block_size=4)
    prompts = [{"prompt_token_ids": list(range(1, 1 + n))} for n in (5, 9, 3)]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    recorder = StepShapes(llm.engine)
    llm.generate(prompts, sp, use_tqdm=False)
    recorder.detach()
    # One prefill step of all 17 prompt tokens (3 sampled rows), then 2 decode steps of 3.
    assert recorder.shapes == [(17, 3), (3, 3), (3, 3)]
    n = len(recorder.shapes)
    llm.generate(prompts[:1], sp, use_tqdm=False)
    assert len(recorder.shapes) == n  # detached: no longer recording
    model = llm.engine.executor.worker.model
    assert linears_ms(model, 4, 0) > 0
    assert workload_floor_s(model, recorder.shapes) > 0
