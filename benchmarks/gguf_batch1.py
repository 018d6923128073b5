"""Batch-1 decode tokens/s on a GGUF file: pagedllm float32 (dequantized at load), pagedllm
``quantization="gguf"`` (blocks kept, native kernels) and llama.cpp (issue 22 item 4).

llama.cpp runs through ``llama-cpp-python`` built from PyPI source into its own venv
(``--llamacpp-venv``, created on first use; several minutes) with explicit instruction-set flags
for this CPU (AVX2/FMA/F16C; AVX-512 added where present, AMX kept off), in a child process that
loads the same file with the same thread count. Each engine prefills the same prompt and then
decodes ``--tokens`` greedy tokens one at a time; decode tokens/s = tokens / decode seconds. The
three are run alternately ``--runs`` times; medians, the ratio to llama.cpp and the CPU flags are
printed. Each engine's process CPU seconds over the decode are also turned into a "CPU-time"
tokens/s: on a shared machine where other jobs take the cores, wall time mostly measures the
wait, while at one thread the CPU time is close to what a quiet machine gives (both are
printed; at two threads CPU time also counts the threads' spinning at barriers). ``--split``
also times where one pagedllm gguf decode step goes (the decoder layers, the LM head, preparing
the step's tensors, the rest of the engine).

    .venv/bin/python benchmarks/gguf_batch1.py --runs 5 --split
"""

from __future__ import annotations

import pagedllm  # noqa: F401 (first: it sets OpenMP's barrier spin before torch loads libgomp)

# isort: split
import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_lock, median, merge_json  # noqa: E402

PROMPT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle. Describe "
    "the storm, the keeper's small house, and what the message says."
)

# Child process: load the model once, then answer one timing per line read from stdin.
LLAMA_CHILD = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    from llama_cpp import Llama
    path, threads, tokens, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=1024,
                n_batch=512, verbose=False, logits_all=False)
    ids = llm.tokenize(prompt.encode(), add_bos=True)
    print(json.dumps({"ready": True, "prompt_tokens": len(ids)}), flush=True)
    for _ in sys.stdin:
        llm.reset()
        llm.eval(ids)
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(tokens):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        print(json.dumps({"tok_s": tokens / dt, "cpu_tok_s": tokens / dc}), flush=True)
    """
)


def llamacpp_cmake_args() -> str:
    """CMAKE_ARGS for this CPU: never -march=native (GGML_NATIVE=OFF), AVX2/FMA/F16C, AVX-512
    and its VBMI / VNNI / BF16 extensions where present (llama.cpp's best build here), AMX off
    (a native AMX build crashed)."""
    from pagedllm.platform import cpu_flags

    flags = cpu_flags()
    args = ["-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"]
    if flags.avx512f:
        args.append("-DGGML_AVX512=ON")
        for flag, option in (
            ("avx512vbmi", "GGML_AVX512_VBMI"),
            ("avx512_vnni", "GGML_AVX512_VNNI"),
            ("avx512_bf16", "GGML_AVX512_BF16"),
        ):
            if flags.has(flag):
                args.append(f"-D{option}=ON")
    args.append("-DGGML_AMX_INT8=OFF")
    return " ".join(args)


def ensure_llamacpp(venv: Path) -> Path:
    """The venv's python with llama_cpp importable; builds it from the PyPI sdist if needed."""
    py = venv / "bin" / "python"
    if (
        py.exists()
        and subprocess.run([py, "-c", "import llama_cpp"], capture_output=True).returncode == 0
    ):
        return py
    print(f"building llama-cpp-python into {venv} (several minutes)...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "CMAKE_ARGS": llamacpp_cmake_args()}
    subprocess.run(
        [
            py,
            "-m",
            "pip",
            "install",
            "--no-binary",
            "llama-cpp-python",
            "llama-cpp-python",
            "numpy",
        ],
        check=True,
        env=env,
    )
    return py


class LlamaCpp:
    """llama.cpp in a child process; :meth:`run` returns one measurement of decode tokens/s."""

    def __init__(self, py: Path, path: Path, threads: int, tokens: int) -> None:
        self.proc = subprocess.Popen(
            [py, "-c", LLAMA_CHILD, str(path), str(threads), str(tokens), PROMPT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = json.loads(self._line())
        self.prompt_tokens = int(ready["prompt_tokens"])

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("llama.cpp child exited")
        return line

    def run(self) -> tuple[float, float]:
        """(wall tokens/s, CPU-time tokens/s) of one decode."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        got = json.loads(self._line())
        return float(got["tok_s"]), float(got["cpu_tok_s"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def pagedllm_engine(loaded: Any, quantization: str | None, threads: int, tokens: int) -> Any:
    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine

    cfg = EngineConfig(
        dtype="float32",
        max_model_len=512,
        num_threads=threads,
        max_num_seqs=1,
        quantization=quantization,
    )
    return LLMEngine(cfg, loaded=loaded)


def pagedllm_decode(
    engine: Any, tokens: int, on_prefilled: Callable[[], None] | None = None
) -> tuple[float, list[float], float]:
    """(decode tokens/s, per-step seconds, CPU-time tokens/s) of one greedy request: the first
    step (prefill and the first token) is excluded; ``on_prefilled`` runs after it."""
    from pagedllm.sampling_params import SamplingParams

    engine.add_request(
        f"r{time.monotonic_ns()}",
        PROMPT,
        SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True),
    )
    engine.step()  # prefill
    if on_prefilled is not None:
        on_prefilled()
    steps = []
    c0 = time.process_time()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    return len(steps) / sum(steps), steps, len(steps) / (time.process_time() - c0)


def step_split(engine: Any, tokens: int) -> dict[str, float]:
    """Milliseconds per decode step spent in the decoder layers (embedding included; one C++
    op when the layers are fused), the final norm + LM head, preparing the step's tensors, and
    everything else (scheduler, sampling, detokenizing, Python)."""
    model = engine.executor.worker.model
    runner = engine.executor.worker.runner
    spent: dict[str, float] = defaultdict(float)

    def timed(obj: Any, name: str, kind: str) -> None:
        inner = getattr(obj, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[kind] += time.perf_counter() - t0

        setattr(obj, name, wrapper)

    timed(model, "run_layers", "layers")
    timed(model, "compute_logits", "head")
    timed(runner, "_prepare", "prepare")
    _, steps, _ = pagedllm_decode(engine, tokens, on_prefilled=spent.clear)
    calls = len(steps)
    step_ms = 1e3 * sum(steps) / calls
    per_step = {k: 1e3 * v / calls for k, v in spent.items()}
    return {
        "step_ms": step_ms,
        "layers_ms (embedding + decoder layers)": per_step["layers"],
        "lm_head_ms (final norm + LM head)": per_step["head"],
        "prepare_ms (step tensors)": per_step["prepare"],
        "rest_ms (scheduler, sampling, output)": step_ms - sum(per_step.values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file; default: the bundled SmolLM2 Q4_1")
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens per run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llamacpp-venv", default="/tmp/llamacpp-venv")
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--split", action="store_true", help="time the parts of a gguf decode step")
    ap.add_argument("--out", default="benchmarks/results/gguf_batch1.json")
    args = ap.parse_args()

    from pagedllm.model.loader import load_model, resolve_model_path
    from pagedllm.platform import cpu_flags

    torch.set_num_threads(args.threads)
    path, kind = resolve_model_path(args.model)
    if kind != "gguf":
        raise SystemExit(f"{path} is not a GGUF file")
    print(f"cpu flags: {cpu_flags().summary()}; threads {args.threads}; file {path}")
    loaded = load_model(str(path), torch.float32)
    engines = {
        q or "fp32": pagedllm_engine(loaded, q, args.threads, args.tokens) for q in (None, "gguf")
    }
    llama = None
    if not args.skip_llamacpp:
        py = ensure_llamacpp(Path(args.llamacpp_venv))
        llama = LlamaCpp(py, path, args.threads, args.tokens)
    results: dict[str, list[float]] = defaultdict(list)
    with bench_lock():
        for eng in engines.values():
            pagedllm_decode(eng, 8)  # warm up
        if llama is not None:
            llama.run()
        for _ in range(args.runs):
            for name, eng in engines.items():
                wall, _, cpu = pagedllm_decode(eng, args.tokens)
                results[f"pagedllm {name}"].append(wall)
                results[f"pagedllm {name} (CPU time)"].append(cpu)
            if llama is not None:
                wall, cpu = llama.run()
                results["llama.cpp"].append(wall)
                results["llama.cpp (CPU time)"].append(cpu)
        split = step_split(engines["gguf"], args.tokens) if args.split else None
    if llama is not None:
        llama.close()
    summary: dict[str, Any] = {"cpu_flags": cpu_flags().summary(), "threads": args.threads}
    for name, xs in results.items():
        summary[name] = median(xs)
        print(f"{name:>29}: median {median(xs):7.1f} tok/s  runs {[round(x, 1) for x in xs]}")
    if llama is not None:
        for clock in ("", " (CPU time)"):
            for name in ("pagedllm fp32", "pagedllm gguf"):
                ratio = summary[name + clock] / summary["llama.cpp" + clock]
                summary[f"{name} / llama.cpp{clock}"] = ratio
                print(f"{name} / llama.cpp{clock}: {ratio:.2f}x")
    if split is not None:
        summary["gguf_step_split_ms"] = split
        for k, v in split.items():
            print(f"  gguf decode step: {k}: {v:.2f}")
    merge_json(args.out, {"gguf_batch1": summary})


if __name__ == "__main__":
    main()
