"""Quality of each weight x KV-cache dtype against fp32: perplexity on held-out text and the share
of teacher-forced next-token argmaxes equal to fp32's (issue 22 item 6).

Held-out text: the assistant replies ("gpt" turns) of the LAST ``--texts`` ShareGPT records in
``../shared/data/sharegpt_1024.json`` that have at least ``--min-tokens`` tokens, cut to
``--max-tokens``. The benchmarks read ShareGPT's first human turns as prompts and use the replies
only for their lengths, and no test reads the reply texts, so these texts are not tuned on.

Teacher-forced through the engine: each text is a prompt with ``prompt_logprobs=1`` and
``max_tokens=1``, so every position's log-probability of the true next token and its top-1 token
come from the engine's own forward (prefill kernels, KV cache, quantized linears). Perplexity =
exp(mean negative log-likelihood over all predicted positions of all texts). Bundled model
(SmolLM2-135M-Instruct) unless ``--model``.

Settings: ``--weights`` (fp32, bf16, int8, int8-head = int8 with an int8 LM head too, int8-bf16 =
int8 with bf16 activations, KV cache and LM head; more
slot into ``WEIGHTS``) x ``--kv-cache-dtypes`` (``auto`` = the weights' dtype; other values are
passed as ``kv_cache_dtype`` when the engine has that option). Targets (issue 22): bf16 within 1%,
int8 W8A8 within 3%, fp8/int8 KV within 2% of fp32's perplexity.

    python benchmarks/perplexity.py --weights fp32,bf16,int8 --texts 16

On a CPU without bf16 hardware (no AMX-BF16 / AVX512-BF16, e.g. AMD Zen 3) the bf16 row runs
torch's emulated bf16 matmuls, 3-5x slower than fp32 (docs/dtype.md); a shorter set keeps it to a
few CPU-minutes (figures in docs/dtype.md):

    python benchmarks/perplexity.py --weights fp32,bf16 --texts 8 --min-tokens 256 --max-tokens 256
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from pathlib import Path

import torch

# Runs as ``python benchmarks/perplexity.py`` and as ``python -m benchmarks.perplexity``.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import cpu_description, held_out_texts  # noqa: E402
from pagedllm.config import EngineConfig
from pagedllm.entrypoints.llm import LLM
from pagedllm.platform import cpu_flags
from pagedllm.sampling_params import SamplingParams

# weight setting -> (LLM keyword arguments, environment variables set while it is built)
WEIGHTS: dict[str, tuple[dict[str, object], dict[str, str]]] = {
    "fp32": ({"dtype": "float32"}, {}),
    "bf16": ({"dtype": "bfloat16"}, {}),
    "int8": ({"dtype": "float32", "quantization": "int8"}, {}),
    "int8-head": ({"dtype": "float32", "quantization": "int8"}, {"PAGEDLLM_INT8_LM_HEAD": "1"}),
    "int8-bf16": ({"dtype": "bfloat16", "quantization": "int8"}, {}),
}


def teacher_forced(llm: LLM, texts: list[list[int]]) -> tuple[list[float], list[int]]:
    """Per predicted position of every text (positions 1..L-1): the log-probability of the true
    token and the model's top-1 token."""
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": t} for t in texts], sp, use_tqdm=False)
    logprobs: list[float] = []
    argmaxes: list[int] = []
    for text, out in zip(texts, outs, strict=True):
        assert out.prompt_logprobs is not None
        for tok, pos in zip(text[1:], out.prompt_logprobs[1:], strict=True):
            assert pos is not None
            logprobs.append(pos[tok].logprob)
            argmaxes.append(next(t for t, lp in pos.items() if lp.rank == 1))
    return logprobs, argmaxes


def run_setting(model: str | None, weights: str, kv: str, texts_n: int, args) -> dict:
    kwargs, env = WEIGHTS[weights]
    kw = dict(
        kwargs,
        max_model_len=args.max_tokens + 8,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=False,
    )
    if kv != "auto":
        if "kv_cache_dtype" not in {f.name for f in dataclasses.fields(EngineConfig)}:
            raise SystemExit(f"--kv-cache-dtypes {kv}: this engine has no kv_cache_dtype option")
        kw["kv_cache_dtype"] = kv
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        t0 = time.perf_counter()
        llm = LLM(model, **kw)
        texts = held_out_texts(llm.get_tokenizer(), texts_n, args.min_tokens, args.max_tokens)
        logprobs, argmaxes = teacher_forced(llm, texts)
        seconds = time.perf_counter() - t0
        llm.engine.shutdown()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    nll = -sum(logprobs) / len(logprobs)
    return {"weights": weights, "kv": kv, "ppl": math.exp(nll), "argmax": argmaxes,
            "positions": len(logprobs), "texts": len(texts), "seconds": seconds}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder / GGUF file (default: bundled)")
    p.add_argument("--weights", default="fp32,bf16,int8", help=f"from {', '.join(WEIGHTS)}")
    p.add_argument("--kv-cache-dtypes", default="auto", help="comma list; auto = weights' dtype")
    p.add_argument("--texts", type=int, default=16, help="held-out replies")
    p.add_argument("--min-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=384)
    p.add_argument("--kv-cache-memory", default="256MiB")
    args = p.parse_args()
    weights = [w.strip() for w in args.weights.split(",") if w.strip()]
    unknown = [w for w in weights if w not in WEIGHTS]
    if unknown:
        p.error(f"--weights: unknown {unknown}; known: {', '.join(WEIGHTS)}")
    kvs = [k.strip() for k in args.kv_cache_dtypes.split(",") if k.strip()]

    print(f"CPU: {cpu_description()} | torch threads {torch.get_num_threads()}")
    flags = cpu_flags()
    if "bf16" in weights and not (flags.amx_bf16 or flags.avx512_bf16):
        print(
            "note: no bf16 hardware here, the bf16 row is 3-5x slower than fp32; a shorter set: "
            "--texts 8 --min-tokens 256 --max-tokens 256"
        )
    ref = run_setting(args.model, "fp32", "auto", args.texts, args)
    print(f"held-out: last {ref['texts']} ShareGPT replies, {ref['positions']} predicted tokens")
    print(
        f"{'weights':>10} {'kv':>8} {'perplexity':>11} {'vs fp32':>8} {'argmax=fp32':>12} {'s':>6}"
    )
    report(ref, ref)
    for w in weights:
        for kv in kvs:
            if (w, kv) != ("fp32", "auto"):
                report(run_setting(args.model, w, kv, args.texts, args), ref)


def report(r: dict, ref: dict) -> None:
    """One table row, printed as soon as the setting has run."""
    same = sum(a == b for a, b in zip(r["argmax"], ref["argmax"], strict=True))
    rel = r["ppl"] / ref["ppl"] - 1
    print(
        f"{r['weights']:>10} {r['kv']:>8} {r['ppl']:>11.4f} {rel:>+8.2%} "
        f"{same / len(ref['argmax']):>12.2%} {r['seconds']:>6.1f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
