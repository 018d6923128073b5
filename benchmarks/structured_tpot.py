"""Cost of structured outputs in the engine: TPOT at batch 32 with every request constrained by
a JSON schema vs unconstrained, and TTFT with a cold vs a cached schema (bundled SmolLM2).

Decode: 32 prompts, 64 generated tokens each, all in one batch. Unconstrained rows use
``ignore_eos``; constrained rows use a schema that cannot end within 64 tokens (an array of at
least 100 records), so both runs generate exactly 64 tokens per request. TPOT of a request =
(finished - first token) / 63; the figure is the median over requests, best of ``--repeats``
alternating runs. TTFT: one request alone, with a schema never seen (compile included; the
tokenizer tables are built beforehand) vs the same schema again (cache hit).

Run: ``PYTHONPATH=. python benchmarks/structured_tpot.py [--repeats 2]``; prints figures and
writes benchmarks/results/structured_tpot.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from pagedllm import LLM, SamplingParams, StructuredOutputsParams

BATCH = 32
OUT_TOKENS = 64


def records_schema(tag: str) -> dict[str, Any]:
    """A schema that cannot be completed within OUT_TOKENS tokens; ``tag`` makes it distinct."""
    return {
        "title": tag,
        "type": "object",
        "properties": {
            "records": {
                "type": "array",
                "minItems": 100,
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 20},
                        "score": {"type": "integer", "minimum": 0, "maximum": 100},
                        "kind": {"enum": ["a", "b", "c"]},
                    },
                    "required": ["name", "score", "kind"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["records"],
        "additionalProperties": False,
    }


def tpot_ms(llm: LLM, prompts: list[str], sp: SamplingParams) -> float:
    outs = llm.generate(prompts, sp, use_tqdm=False)
    per_req = []
    for o in outs:
        m = o.metrics
        assert m is not None and m.first_token_time is not None and m.finished_time is not None
        assert len(o.outputs[0].token_ids) == OUT_TOKENS, o.outputs[0].finish_reason
        per_req.append((m.finished_time - m.first_token_time) / (OUT_TOKENS - 1) * 1e3)
    return statistics.median(per_req)


def ttft_ms(llm: LLM, prompt: str, spec: StructuredOutputsParams) -> float:
    # Through add_request + step (LLM.generate would compile in validate first).
    eng = llm.engine
    rid = f"ttft-{time.monotonic_ns()}"
    t0 = time.monotonic()
    eng.add_request(rid, prompt, SamplingParams(max_tokens=1, structured_outputs=spec))
    while eng.has_unfinished_requests():
        eng.step()
    return (time.monotonic() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/structured_tpot.json")
    args = ap.parse_args()
    llm = LLM(max_num_seqs=BATCH)
    prompts = [f"Write record number {i} of the dataset as JSON." for i in range(BATCH)]
    free = SamplingParams(max_tokens=OUT_TOKENS, ignore_eos=True, temperature=0.8, seed=1)
    spec = StructuredOutputsParams(json=records_schema("bench"))
    cons = SamplingParams(max_tokens=OUT_TOKENS, temperature=0.8, seed=1, structured_outputs=spec)
    tpot_ms(llm, prompts[:4], free)  # warm-up (kernels, grammar tables, the schema's compile)
    tpot_ms(llm, prompts[:4], cons)
    runs: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
    for _ in range(args.repeats):
        runs["unconstrained"].append(tpot_ms(llm, prompts, free))
        runs["constrained"].append(tpot_ms(llm, prompts, cons))
    best = {k: min(v) for k, v in runs.items()}
    ratio = best["constrained"] / best["unconstrained"]
    cold = [ttft_ms(llm, prompts[0], StructuredOutputsParams(json=records_schema(f"c{i}")))
            for i in range(3)]
    cached = [ttft_ms(llm, prompts[0], StructuredOutputsParams(json=records_schema("c0")))
              for _ in range(3)]
    result = {
        "batch": BATCH, "out_tokens": OUT_TOKENS, "tpot_ms_runs": runs,
        "tpot_ms_best": best, "tpot_ratio": ratio,
        "ttft_ms_cold_median": statistics.median(cold),
        "ttft_ms_cached_median": statistics.median(cached),
    }
    print(f"TPOT batch {BATCH}: unconstrained {best['unconstrained']:.1f} ms, constrained "
          f"{best['constrained']:.1f} ms (x{ratio:.3f}); runs {runs}")
    print(f"TTFT one request: cold schema {result['ttft_ms_cold_median']:.0f} ms, cached "
          f"{result['ttft_ms_cached_median']:.0f} ms (medians of 3)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
