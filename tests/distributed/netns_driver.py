"""The engine driver run inside the Ray head's network namespace (``NetnsCluster.run_in``).

Usage: ``python -m tests.distributed.netns_driver JOB.pkl OUT.json``. The job (a pickled dict)
names the model (``loaded``: a pickled ``LoadedModel``, or ``model``: a path), ``tp``, ``pp``,
``prompts`` and ``mode``: "greedy" writes the greedy tokens, the address every rank bound and
each stage's idle share; "kill" starts long requests, SIGKILLs the first remote rank after a few
steps and writes the error the engine raised and how long it took.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import time
from typing import Any


def _run(job: dict[str, Any]) -> dict[str, Any]:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    model: dict[str, Any] = (
        {"loaded": job["loaded"]} if "loaded" in job else {"model": job["model"]}
    )
    llm = LLM(
        **model,
        tensor_parallel_size=job["tp"],
        pipeline_parallel_size=job["pp"],
        distributed_executor_backend="ray",
        max_model_len=job.get("max_model_len", 256),
        num_gpu_blocks_override=job.get("num_blocks", 64),
        dtype="float32",
    )
    engine = llm.engine
    executor = engine.executor
    out: dict[str, Any] = {"driver_host": executor.host, "rank_hosts": executor.rank_hosts}
    try:
        if job["mode"] == "greedy":
            params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False
            )
            out["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
            stats = executor.driver_worker.runner.pipeline_stats
            out["idle_share"] = stats.idle_share()
            return out
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        for i, p in enumerate(job["prompts"]):
            engine.add_request(str(i), p, params)
        for _ in range(3):
            engine.step()
        os.kill(executor.pids[0], signal.SIGKILL)
        start = time.monotonic()
        try:
            while engine.has_unfinished_requests() and time.monotonic() - start < 120:
                engine.step()
            out["error"] = None
        except Exception as exc:  # the error under test
            out["error"] = f"{type(exc).__name__}: {exc}"
        out["seconds"] = time.monotonic() - start
        return out
    finally:
        engine.shutdown()


def main() -> None:
    """Read the job, run it, write the JSON result."""
    with open(sys.argv[1], "rb") as f:
        job = pickle.load(f)
    result = _run(job)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
