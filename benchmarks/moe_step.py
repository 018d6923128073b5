"""MoE decode step: experts grouped by expert (one call per routed expert) vs a per-token loop.

Builds a small random Mixtral with transformers (fp32; default: 4 layers, d = 256, 8 experts of
width 512, top-2), loads it into the engine and, for each batch size, prefills that many short
prompts and times ``--steps`` whole decode steps (``LLMEngine.step``) plus ``--block-reps`` calls
of the first layer's MoE block alone on a random [batch, d] input (median and min: on a shared
machine the min is the cleaner figure). Modes:

- ``grouped``: ``SparseMoeBlock.forward`` (sort the step's assignments by expert, each routed
  expert once over its rows), experts on the CPU-packed GEMMs;
- ``grouped-unpacked``: the same on ``F.linear`` over the stacked weights (no packing);
- ``per-token``: ``SparseMoeBlock.forward_per_token`` (each token runs its k experts on its own
  row), experts packed.

    .venv/bin/python benchmarks/moe_step.py --batches 1 2 4 8 16 32 --steps 10 --threads 1
"""

from __future__ import annotations

import pagedllm  # noqa: F401 (first: it sets OpenMP's barrier spin before torch loads libgomp)

# isort: split
import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import bench_lock, median  # noqa: E402


def build_model(folder: Path, layers: int, hidden: int, inter: int, experts: int) -> None:
    """A seeded random Mixtral saved with the tiny test tokenizer."""
    import transformers as tf

    from tests.conftest import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    cfg = tf.MixtralConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        head_dim=64,
        num_local_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(0)
    tf.MixtralForCausalLM(cfg).to(torch.float32).save_pretrained(folder)
    tok.save_pretrained(folder)


def per_token_forward(block, x, residual=None):  # type: ignore[no-untyped-def]
    out = block.forward_per_token(x)
    return out if residual is None else residual.add_(out)


def time_mode(
    folder: Path, mode: str, batches: list[int], steps: int, block_reps: int, threads: int
) -> None:
    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.model.layers import moe
    from pagedllm.model.loader import load_model
    from pagedllm.sampling_params import SamplingParams

    original = moe.SparseMoeBlock.forward
    if mode == "per-token":
        moe.SparseMoeBlock.forward = per_token_forward  # type: ignore[method-assign]
    pack = moe.StackedExperts.pack
    if mode == "grouped-unpacked":
        moe.StackedExperts.pack = lambda self, ops: 0  # type: ignore[method-assign]
    try:
        loaded = load_model(str(folder), torch.float32)
        cfg = EngineConfig(max_model_len=256, num_threads=threads, max_num_seqs=max(batches))
        engine = LLMEngine(cfg, loaded=loaded)
        model = engine.executor.worker.model
        block = model.layers[0].mlp
        g = torch.Generator().manual_seed(0)
        sp = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
        for b in batches:
            for i in range(b):
                prompt = torch.randint(3, loaded.config.vocab_size, (16,), generator=g).tolist()
                engine.add_request(f"{b}-{i}", prompt, sp)
            engine.step()  # prefill
            engine.step()  # warm decode
            step_ms = []
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()
                step_ms.append((time.perf_counter() - t0) * 1e3)
            while engine.has_unfinished_requests():
                engine.step()
            x = torch.randn(b, loaded.config.hidden_size, generator=g)
            block_ms = []
            for _ in range(block_reps):
                t0 = time.perf_counter()
                with torch.inference_mode():
                    block(x)
                block_ms.append((time.perf_counter() - t0) * 1e3)
            print(
                f"{mode:17s} batch {b:3d}: step median {median(step_ms):7.2f} ms "
                f"(min {min(step_ms):7.2f})   MoE block (layer 0) median "
                f"{median(block_ms):6.3f} ms (min {min(block_ms):6.3f})",
                flush=True,
            )
        engine.shutdown()
    finally:
        moe.SparseMoeBlock.forward = original  # type: ignore[method-assign]
        moe.StackedExperts.pack = pack  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--block-reps", type=int, default=50, help="timed calls of the MoE block")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--modes", nargs="+", default=["grouped", "grouped-unpacked", "per-token"])
    args = ap.parse_args()

    from pagedllm.attention.cpu import load_cpu_ops

    torch.set_num_threads(args.threads)
    ops = load_cpu_ops()
    print(
        f"CPU: {platform.processor() or platform.machine()}, {args.threads} threads, "
        f"C++ ops {ops.simd_level() if ops else 'unavailable'}; model: Mixtral-style, "
        f"{args.layers} layers, d={args.hidden}, {args.experts} experts x I={args.inter}, top-2"
    )
    with tempfile.TemporaryDirectory() as tmp, bench_lock():
        folder = Path(tmp)
        build_model(folder, args.layers, args.hidden, args.inter, args.experts)
        for mode in args.modes:
            time_mode(folder, mode, args.batches, args.steps, args.block_reps, args.threads)


if __name__ == "__main__":
    main()
