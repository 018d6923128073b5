"""Tensor parallelism (paper section 4.6) on this machine: throughput at tp = 1 vs tp > 1, and the
bytes the driver sends to every worker per step (the pickled ``SchedulerOutput``).

Two models:
  * ``random8``: SmolLM2-135M's shapes and tokenizer (30 layers, d 576, SwiGLU 1536, vocab 49152)
    but 8 query / 4 KV heads of 72 dims and random weights, so that tp = 2 divides the heads;
  * ``smollm``: the bundled SmolLM2-135M-Instruct (9 query / 3 KV heads), so tp = 3.
A 2-core CPU has nothing to gain from splitting a 135M model (every rank competes for the same
cores and every layer adds two all-reduces), so expect a slow-down: the point is correctness.

Workload: ``--num-prompts`` random prompts of ``--prompt-len`` tokens, ``--output-len`` greedy
tokens each (ignore_eos), all submitted at once; throughput = (prompt + output tokens) / wall s.
Message size: pickled ``SchedulerOutput`` bytes of decode steps with batch 1 and batch
``--num-prompts``. Timed: holds /tmp/pagedllm_bench.lock (flock) while measuring.

    .venv/bin/python benchmarks/tensor_parallel.py            # ~3-5 min on 2 cores
"""

from __future__ import annotations

import pagedllm  # noqa: F401 (first: it sets OpenMP's barrier spin before torch loads libgomp)

# isort: split
import argparse
import json
import pickle
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_lock, merge_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def random8(smollm):
    """SmolLM2-135M's shapes with 8 / 4 heads and random weights (tokenizer kept)."""
    from pagedllm.model.loader import LoadedModel

    cfg = replace(smollm.config, num_attention_heads=8, num_key_value_heads=4, head_dim=72)
    g = torch.Generator().manual_seed(0)
    sd = {}
    for name, t in smollm.state_dict.items():
        shape = list(t.shape)
        if "q_proj" in name:
            shape[0] = 8 * 72
        elif "k_proj" in name or "v_proj" in name:
            shape[0] = 4 * 72
        elif "o_proj" in name:
            shape[1] = 8 * 72
        if t.dim() == 1:
            sd[name] = torch.ones(shape)
        else:
            sd[name] = torch.randn(shape, generator=g) * shape[-1] ** -0.5
    return LoadedModel(cfg, sd, smollm.tokenizer, Path("<random8>"), 0)


def run(loaded, tp: int, args) -> dict:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    llm = LLM(
        loaded=loaded,
        tensor_parallel_size=tp,
        max_model_len=args.prompt_len + args.output_len + 16,
        num_gpu_blocks_override=2048,
        enable_prefix_caching=False,
        num_threads=args.num_threads,
    )
    engine = llm.engine
    sizes: dict[int, int] = {}  # decode batch size -> pickled SchedulerOutput bytes
    inner = engine.executor.execute_model

    def spy(sched):
        if all(len(w.token_ids) == 1 for _, w in sched.scheduled):
            sizes[len(sched.scheduled)] = len(pickle.dumps(sched, pickle.HIGHEST_PROTOCOL))
        return inner(sched)

    engine.executor.execute_model = spy  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(1)
    vocab = loaded.config.vocab_size
    prompts = [
        {"prompt_token_ids": torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()}
        for _ in range(args.num_prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up, and the batch-1 message size
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
    out_ids = [list(o.outputs[0].token_ids) for o in outs]
    llm.shutdown()
    return {
        "tp": tp,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
        "output_tokens_per_s": round(args.num_prompts * args.output_len / wall, 1),
        "msg_bytes_batch1": sizes.get(1),
        f"msg_bytes_batch{args.num_prompts}": sizes.get(args.num_prompts),
        "outputs": out_ids,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--models", default="random8,smollm")
    p.add_argument(
        "--num-threads", type=int, default=None, help="torch threads in all (split over ranks)"
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tensor_parallel.json"))
    args = p.parse_args()

    from pagedllm.model.loader import load_model

    smollm = load_model(None, torch.float32)
    plans = {"random8": (random8(smollm), (1, 2)), "smollm": (smollm, (1, 3))}
    result: dict = {"workload": vars(args) | {"cpu_threads": torch.get_num_threads()}}
    key = "" if args.num_threads is None else f"_threads{args.num_threads}"
    with bench_lock():
        for name in args.models.split(","):
            loaded, tps = plans[name]
            rows = [run(loaded, tp, args) for tp in tps]
            same = all(r["outputs"] == rows[0]["outputs"] for r in rows)
            for r in rows:
                r.pop("outputs")
            result[name + key] = {"runs": rows, "greedy_outputs_identical": same}
            print(f"{name}: identical greedy outputs across tp: {same}")
            for r in rows:
                print("  " + json.dumps(r))
    merge_json(args.out, result)


if __name__ == "__main__":
    main()
