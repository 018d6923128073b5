"""Replay the speculation policies on the model's own greedy answers, with a step cost model.

Greedy verification keeps exactly the drafts that equal the model's greedy output, so replaying a
proposer over the speculation-off output (the bundled SmolLM2-135M-Instruct, fp32, on the
repetitive workload of ``benchmarks/spec_workload.py``) gives the exact drafts, acceptances and
rows of every step without running the model again. The sequences of a batch advance in lockstep
(as the engine's steps do), a batch at a time (as ``benchmarks/spec_decode.py`` runs them); each
step costs ``T(R) = 1 + row_cost * max(0, R - knee)`` decode
steps for R rows (the model of ``spec_decode.policy``), so the printed speed-ups are modelled,
not measured (``benchmarks/spec_decode.py`` measures), but they do not depend on the machine's
load. Two per policy: of the wall time, and of the mean per-request time per output token (TPOT:
a request's time from its first token to its last over its tokens after the first, the figure
``spec_decode.py`` reports), which weighs each request alike: a request whose drafts miss pays
for its neighbours' rows. Policies: ``halving`` (the earlier rule: k grows by one after a fully accepted run, halves
after a miss) and ``goodput`` (``DraftAllocator`` on its prior cost model, drafts valued by their
proposals' match lengths). With ``--curve``
(a step time curve measured by ``benchmarks/spec_cutoff.py``) the steps are timed on that curve
instead, and ``goodput-learned`` also runs: the allocator is told every step's curve time (as the
engine tells it the measured forward time), and its figure is a second pass over the workload
with what the first pass learned. ``oracle`` verifies exactly the drafts that will be accepted:
the bound no policy over the same proposals can pass (speculation's ceiling on that cost curve).

    PAGEDLLM_DATA=../shared/data PYTHONPATH=. python benchmarks/spec_policy_replay.py [--k 4]
        [--batches 1 8 16] [--curve 1:26.4,8:34.2,16:44.2,40:94.5]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from benchmarks.spec_workload import build_repetitive_prompts, build_repetitive_tasks
from pagedllm.spec_decode.policy import DraftAllocator
from pagedllm.spec_decode.proposer import MatchingProposer, NgramProposer
from pagedllm.spec_decode.suffix import SuffixProposer


def greedy_answers(n: int, cache: Path) -> list[dict[str, Any]]:
    """``n`` (prompt ids, greedy output ids) of the workload, cached in ``cache`` (JSON)."""
    if cache.exists():
        return list(json.loads(cache.read_text()))
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.model.loader import load_model
    from pagedllm.sampling_params import SamplingParams

    loaded = load_model(None, torch.float32)
    tok = loaded.tokenizer
    tasks = build_repetitive_tasks(n, seed=0)
    prompts = build_repetitive_prompts(n, seed=0, tokenizer=tok)
    params = [SamplingParams(temperature=0, max_tokens=min(96, len(tok(t.reference).input_ids)))
              for t in tasks]
    outs = LLM(loaded=loaded, max_model_len=2048).generate(prompts, params, use_tqdm=False)
    pairs = [{"prompt": list(o.prompt_token_ids), "out": list(o.outputs[0].token_ids)} for o in outs]
    cache.write_text(json.dumps(pairs))
    return pairs


def parse_curve(text: str) -> list[tuple[int, float]]:
    """``"1:26.4,8:34.2,40:94.5"`` (rows:ms of a measured step) -> sorted (rows, ms) pairs.

    Raises:
        ValueError: on a malformed pair or fewer than two of them.
    """
    points = sorted((int(r), float(t)) for r, t in (p.split(":") for p in text.split(",")))
    if len(points) < 2:
        raise ValueError("--curve needs at least two rows:ms pairs")
    return points


def curve_time(points: list[tuple[int, float]], rows: int) -> float:
    """Step time of ``rows`` rows on a measured curve: linear between its points, the end
    segments' slopes carried on past them."""
    i = next((j for j in range(1, len(points)) if rows <= points[j][0]), len(points) - 1)
    (ra, ta), (rb, tb) = points[i - 1], points[i]
    return max(ta + (tb - ta) * (rows - ra) / (rb - ra), 0.0)


def replay(pairs: list[dict[str, Any]], batch: int, policy: str, k: int, proposer: MatchingProposer,
           knee: int, row_cost: float, curve: list[tuple[int, float]] | None = None,
           alloc: DraftAllocator | None = None) -> tuple[float, float, int, int]:
    """(modelled time, mean per-request TPOT, drafts verified, drafts accepted) of one policy.

    Times are in one-token decode steps of the prior model, or in ms of ``curve`` when one is
    given. Policy ``goodput-learned`` reports every step's curve time to the allocator (its
    ``StepCostTable`` learns the curve); pass the same ``alloc`` to a second call to replay
    with what it learned.
    """
    if alloc is None:
        alloc = DraftAllocator(knee_rows=knee, row_cost=row_cost)
    goodput = policy.startswith("goodput")
    k_of: dict[int, int] = {}
    time = 0.0
    drafts = accepted = 0
    tpots: list[float] = []  # each request's (last token - first token) / (tokens - 1)
    for lo in range(0, len(pairs), batch):
        first_token = time  # the batch's prefill gave every request its first token
        seqs = [{"id": lo + i, "ids": p["prompt"] + p["out"][:1], "done": 1, "out": p["out"],
                 "n_prompt": len(p["prompt"])} for i, p in enumerate(pairs[lo : lo + batch])]
        while active := [s for s in seqs if s["done"] < len(s["out"])]:
            props: dict[int, list[int]] = {}
            matches: dict[int, int] = {}
            for s in active:
                kk = 0 if policy == "off" else k if goodput or policy == "oracle" else k_of.get(s["id"], k)
                kk = min(kk, len(s["out"]) - s["done"] - 1)  # never past max_tokens
                draft, match = (proposer.propose_matched(s["ids"], s["n_prompt"], kk, str(s["id"]))
                                if kk > 0 else ([], 0))
                props[s["id"]], matches[s["id"]] = draft[:kk], match
            if goodput:
                kept = alloc.allocate({i: len(p) for i, p in props.items() if p}, len(active),
                                      {i: matches[i] for i, p in props.items() if p})
                props.update({i: props[i][:n] for i, n in kept.items()})
            elif policy == "oracle":  # only the drafts that will be accepted: no policy does better
                for s in active:
                    p = props[s["id"]]
                    a = 0
                    while a < len(p) and p[a] == s["out"][s["done"] + a]:
                        a += 1
                    props[s["id"]] = p[:a]
            rows = 0
            for s in active:
                p = props[s["id"]]
                a = 0
                while a < len(p) and p[a] == s["out"][s["done"] + a]:
                    a += 1
                take = s["out"][s["done"] : s["done"] + a + 1]
                s["ids"] = s["ids"] + take
                s["done"] += len(take)
                rows += 1 + len(p)
                drafts += len(p)
                accepted += a
                if p:
                    alloc.record(s["id"], len(p), a)
                    k_of[s["id"]] = len(p) + 1 if a == len(p) else max(1, len(p) // 2) if a == 0 else len(p)
            step = 1.0 + row_cost * max(0, rows - knee) if curve is None else curve_time(curve, rows)
            time += step
            if policy == "goodput-learned":
                alloc.observe_step(rows, step)
            tpots += [(time - first_token) / (len(s["out"]) - 1) for s in active
                      if s["done"] == len(s["out"])]
        for s in seqs:
            proposer.on_request_finished(s["ids"], s["n_prompt"], str(s["id"]))
    return time, sum(tpots) / max(len(tpots), 1), drafts, accepted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--knee", type=int, default=6)
    ap.add_argument("--row-cost", type=float, default=0.025)
    ap.add_argument("--cache", default="/tmp/pagedllm_spec_answers.json")
    ap.add_argument("--curve", type=parse_curve, default=None,
                    help="measured step times as rows:ms pairs (benchmarks/spec_cutoff.py), e.g. "
                         "1:26.4,8:34.2,40:94.5: steps are then timed on this curve, the policies "
                         "keep --knee / --row-cost as their prior, and goodput-learned learns the "
                         "curve (its figure: a second replay with what the first learned)")
    args = ap.parse_args()
    pairs = greedy_answers(args.n, Path(args.cache))
    timing = (f"T(R) = 1 + {args.row_cost} * max(0, R - {args.knee})" if args.curve is None
              else f"steps timed on the curve {args.curve}")
    print(f"{len(pairs)} greedy answers, {sum(len(p['out']) for p in pairs)} output tokens; "
          f"{timing}; k = {args.k}")
    policies = ("halving", "goodput") if args.curve is None else ("halving", "goodput", "goodput-learned")
    policies += ("oracle",)
    for method in ("ngram", "suffix"):
        for batch in args.batches:
            line = [f"{method} batch {batch}:"]
            off, off_tpot, _, _ = replay(pairs, batch, "off", 0, NgramProposer(), args.knee,
                                         args.row_cost, args.curve)
            for policy in policies:
                alloc = DraftAllocator(knee_rows=args.knee, row_cost=args.row_cost)
                for _ in range(2 if policy == "goodput-learned" else 1):  # learn, then measure
                    proposer: MatchingProposer = NgramProposer(1, 4) if method == "ngram" else SuffixProposer()
                    t, tpot, d, a = replay(pairs, batch, policy, args.k, proposer, args.knee,
                                           args.row_cost, args.curve, alloc)
                line.append(f"{policy} wall {off / t:.2f}x TPOT {off_tpot / tpot:.2f}x "
                            f"(drafts {d}, accepted {a})")
            print(" ".join(line))


if __name__ == "__main__":
    main()
