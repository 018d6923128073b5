"""KV blocks a sequence holds over a long generation with sliding-window attention.

1. A fully windowed tiny Mistral (random weights, fp32; ``--window`` 64, ``--block-size`` 16)
   generates ``--tokens`` (2,000) greedy tokens. The blocks its sequence holds during every step
   are recorded (the step's peak: after its slots are allocated, before the blocks behind the
   window go back); the script prints them over time, checks the maximum against
   ``ceil(window / block_size) + 1``, and checks the tokens against the same engine with freeing
   turned off and against transformers (one teacher-forced forward pass over the whole sequence).
2. A Gemma-3-like tiny model (5 local layers with the same window, then 1 global layer) under
   the mixed-model policy (one block table for all layers, nothing freed; docs/sliding_window.md):
   KV bytes per sequence vs length, next to what the windowed model holds and what a per-layer
   policy (local layers bounded by the window) would hold.

Memory figures only (block counts), so the machine's load does not change them.

    .venv/bin/python benchmarks/sliding_window_memory.py [--tokens 2000 --window 64]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from pagedllm.entrypoints.llm import LLM  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402
from tests.model.arch_utils import build_tiny_hf_model  # noqa: E402

PROMPT_LEN = 24


def record_blocks_held(llm: LLM) -> list[int]:
    """Blocks held by the scheduled sequence at every slot allocation (one per step here)."""
    bm = llm.engine.block_manager
    held: list[int] = []
    allocate = bm.allocate_slots

    def allocate_and_count(seq: Any, n: int) -> list[tuple[int, int]]:
        copies = allocate(seq, n)
        held.append(bm.num_live_blocks(seq))
        return copies

    bm.allocate_slots = allocate_and_count  # type: ignore[method-assign]
    return held


def generate(folder: Path, prompt: list[int], tokens: int, block_size: int, free: bool,
             num_blocks: int) -> tuple[list[int], list[int], int]:
    """(tokens, blocks held per step, block bytes) of one greedy generation."""
    llm = LLM(str(folder), dtype="float32", block_size=block_size, max_model_len=tokens + 64,
              num_gpu_blocks_override=num_blocks)
    if not free:
        llm.engine.block_manager.sliding_window = None  # type: ignore[attr-defined]
    held = record_blocks_held(llm)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    return list(out), held, llm.engine.block_bytes


@torch.no_grad()
def transformers_agrees(hf: Any, prompt: list[int], tokens: list[int]) -> tuple[int, int]:
    """(steps where transformers' greedy choice equals pagedllm's token, steps whose top-2 logit
    gap exceeds 1e-3), over ``prompt + tokens`` in one forward pass."""
    logits = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :].float()
    top = torch.topk(logits, 2, dim=-1).values
    clear = (top[:, 0] - top[:, 1]) > 1e-3
    same = logits.argmax(-1) == torch.tensor(tokens)
    return int((same & clear).sum()), int(clear.sum())


def windowed(args: argparse.Namespace, tmp: Path) -> int:
    folder = tmp / "mistral"
    hf = build_tiny_hf_model("mistral", folder, sliding_window=args.window,
                             max_position_embeddings=args.tokens + 128)
    prompt = torch.randint(3, hf.config.vocab_size, (PROMPT_LEN,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    bs, w = args.block_size, args.window
    bound = -(-w // bs) + 1
    full = -(-(PROMPT_LEN + args.tokens) // bs)
    toks, held, block_bytes = generate(folder, prompt, args.tokens, bs, True, bound + 4)
    ref_toks, ref_held, _ = generate(folder, prompt, args.tokens, bs, False, full + 4)
    print(f"[windowed] tiny Mistral, window {w}, block size {bs}, prompt {PROMPT_LEN}, "
          f"{args.tokens} greedy tokens; pool {bound + 4} blocks (without freeing the sequence "
          f"needs {full})")
    for step in [0, 1, 2, 3, 4, 8, 16, 50, 100, 250, 500, 1000, 1500, len(held) - 1]:
        if step < len(held):
            context = PROMPT_LEN + step  # the prefill (step 0) computes the prompt
            print(f"[windowed] step {step:5d}  context {context:5d} "
                  f"tokens  blocks held {held[step]:3d} (freeing) {ref_held[step]:4d} (no freeing)")
    ok_bound = max(held) <= bound
    print(f"[windowed] max blocks held {max(held)} <= ceil({w}/{bs}) + 1 = {bound}: {ok_bound}; "
          f"KV per sequence {max(held) * block_bytes} B vs {max(ref_held) * block_bytes} B "
          f"without freeing")
    same = toks == ref_toks
    agree, clear = transformers_agrees(hf, prompt, toks)
    print(f"[windowed] tokens equal to the run without freeing: {same}; transformers' greedy "
          f"choice equals pagedllm's at {agree} of {clear} clear steps")
    return 0 if ok_bound and same and agree == clear else 1


def mixed(args: argparse.Namespace, tmp: Path) -> None:
    folder = tmp / "gemma3"
    layers = ["sliding_attention"] * 5 + ["full_attention"]
    hf = build_tiny_hf_model("gemma3", folder, sliding_window=args.window, num_hidden_layers=6,
                             layer_types=layers, max_position_embeddings=args.mixed_tokens + 128)
    prompt = torch.randint(3, hf.config.vocab_size, (PROMPT_LEN,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    bs, w = args.block_size, args.window
    n = args.mixed_tokens
    _, held, block_bytes = generate(folder, prompt, n, bs, True, -(-(PROMPT_LEN + n) // bs) + 4)
    per_layer_token = block_bytes // bs // len(layers)  # K + V of one token in one layer
    print(f"[mixed] Gemma-3-like tiny model: 5 local layers (window {w}) + 1 global, block size "
          f"{bs}, {per_layer_token} B of K/V per token per layer; policy: one block table, "
          "nothing freed")
    for length in [64, 128, 256, 512, 1024, 2048]:
        step = length - PROMPT_LEN
        if step < 0 or step >= len(held):
            continue
        measured = held[step] * block_bytes
        local = 5 * min(-(-length // bs), -(-w // bs) + 1) * bs * per_layer_token
        per_layer_policy = local + 1 * -(-length // bs) * bs * per_layer_token
        all_windowed = min(held[step], -(-w // bs) + 1) * block_bytes
        print(f"[mixed] length {length:5d}: KV per sequence {measured:8d} B measured "
              f"(= {held[step]} blocks); per-layer policy would hold {per_layer_policy:8d} B; "
              f"an all-windowed model {all_windowed:7d} B")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--mixed-tokens", type=int, default=1100)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        rc = windowed(args, Path(tmp))
        mixed(args, Path(tmp))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
