"""Speculative decoding benchmark (issue 25): time per output token with and without n-gram /
suffix / draft-model speculation on the bundled SmolLM2-135M-Instruct (greedy), at the engine's
default dtype (``--dtype auto``: bf16 on CPUs with bf16 hardware, fp32 elsewhere) unless
``--dtype`` pins one.

Workloads:
- repetitive (``benchmarks/spec_workload.py``: fix typos, extract, to JSON, bullets built from
  ../shared/data; answers copy long spans of the prompt), ``max_tokens`` = the reference answer's
  token count (capped by ``--max-tokens``), at batch 1 (requests one after another) and batch 8;
- ShareGPT at batch 64 (``--sharegpt``): speculation configured, but the policy turns it off
  (``disable_by_batch_size``), so it must cost nothing (target >= 0.97x); at least 3 rounds,
  the two engines alternating, median TPOTs.

TPOT of a request = (finished - first token) / (output tokens - 1); the figure is the mean over
requests. Greedy outputs are checked identical across methods (they must be: verification is
exact). Acceptance rates come from ``EngineStats``.

Run: ``PYTHONPATH=. python benchmarks/spec_decode.py [--n 32] [--batches 1 8] [--sharegpt]
[--methods off ngram suffix draft_model] [--draft-model NAME_OR_PATH] [--repeats R]``. The
methods run interleaved: every method's engine runs a group of prompts (one batch) before any
runs the next, so a slow phase of a shared VM falls on all of them (``--sequential``: whole
cells one after another, as before 2026-12-06). ``--repeats`` runs whole rounds and prints the
median speed-up of each cell.

``--n`` is 32 (8 requests of each kind) since 2026-12-05; it was 8 before, 2 of each kind, too
few to stand for the workload: replayed on the model's greedy bf16 answers, the four groups of 8
of the 32 requests give 2.06x, 2.43x, 2.53x and 2.70x at batch 1 (n-gram, k = 8), and the first
group is the old ``--n 8`` (docs/spec_decode.md, session 28).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from benchmarks.common import sharegpt_prompts
from benchmarks.spec_workload import build_repetitive_prompts, build_repetitive_tasks
from pagedllm.entrypoints.llm import LLM
from pagedllm.model.loader import load_model
from pagedllm.sampling_params import SamplingParams


def run_group(llm: LLM, prompts: list[Any],
              max_tokens: list[int]) -> tuple[list[float | None], list[list[int]]]:
    """One greedy ``generate`` call over ``prompts``: each request's TPOT (seconds; None for a
    request of one output token) and its output token ids, in prompt order."""
    params = [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens]
    tpots: list[float | None] = []
    outputs: list[list[int]] = []
    for o in llm.generate(prompts, params, use_tqdm=False):
        m, n = o.metrics, len(o.outputs[0].token_ids)
        outputs.append(list(o.outputs[0].token_ids))
        timed = n > 1 and m.first_token_time is not None and m.finished_time is not None
        tpots.append((m.finished_time - m.first_token_time) / (n - 1) if timed else None)
    return tpots, outputs


def cell_figures(llm: LLM, st0: dict[str, Any], tpots: list[float | None],
                 outputs: list[list[int]], wall: float) -> dict[str, Any]:
    """A cell's figures: mean TPOT (ms) over the requests of 2+ tokens, each request's TPOT (ms,
    None for one token), wall seconds, output tokens, acceptance (the engine's stats since the
    ``summary()`` ``st0``) and the outputs."""
    st = type(llm.engine.stats).delta(st0, llm.engine.stats.summary())
    per_pos = [
        round(a / d, 3) for a, d in zip(st.spec_accepted_per_pos, st.spec_draft_per_pos, strict=False) if d
    ]
    return {
        "tpot_ms": 1000 * statistics.mean(t for t in tpots if t is not None),
        "request_tpot_ms": [None if t is None else 1000 * t for t in tpots],
        "wall_s": wall,
        "tokens": sum(len(x) for x in outputs),
        "acceptance_rate": st.spec_acceptance_rate,
        "mean_accepted_length": st.spec_mean_accepted_length,
        "acceptance_per_pos": per_pos,
        "outputs": outputs,
    }


def run_batch(llm: LLM, prompts: list[Any], max_tokens: list[int], batch: int) -> dict[str, Any]:
    """Run ``prompts`` ``batch`` at a time (greedy) on one engine; returns ``cell_figures``."""
    return run_interleaved({"": llm}, prompts, max_tokens, batch)[""]


def run_interleaved(llms: dict[str, LLM], prompts: list[Any], max_tokens: list[int],
                    batch: int) -> dict[str, dict[str, Any]]:
    """Run ``prompts`` ``batch`` at a time (greedy) on every engine of ``llms``, group by group:
    all engines run a group before any runs the next, their order rotating by one each group.
    A shared VM's slow phases last seconds to minutes; whole cells one after another let one
    land on a single method (an AMX Xeon's "off" cell at batch 8 read 17-54 ms TPOT between
    runs), while here each phase falls on every method alike. Returns ``cell_figures`` by name.
    """
    names = list(llms)
    st0, wall = {}, dict.fromkeys(names, 0.0)
    tpots: dict[str, list[float | None]] = {n: [] for n in names}
    outputs: dict[str, list[list[int]]] = {n: [] for n in names}
    for name, llm in llms.items():
        llm.engine.reset_prefix_cache()
        st0[name] = llm.engine.stats.summary()
    for i, lo in enumerate(range(0, len(prompts), batch)):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            t0 = time.perf_counter()
            t, o = run_group(llms[name], prompts[lo : lo + batch], max_tokens[lo : lo + batch])
            wall[name] += time.perf_counter() - t0
            tpots[name] += t
            outputs[name] += o
    return {n: cell_figures(llms[n], st0[n], tpots[n], outputs[n], wall[n]) for n in names}


def make_llm(args: argparse.Namespace, loaded: Any, name: str) -> LLM:
    """The engine of method ``name`` (off, ngram, suffix, draft_model; ``-halving`` / ``-fixed``
    variants), speculating up to ``args.k`` tokens at any batch size."""
    method = name.removesuffix("-halving").removesuffix("-fixed")
    spec: dict[str, Any] | None = None
    if method != "off":
        spec = {"method": method, "num_speculative_tokens": args.k, "disable_by_batch_size": 10_000,
                "learn_step_cost": not name.endswith("-fixed")}
    if method == "draft_model":  # default draft: the bundled target itself (already loaded)
        assert spec is not None
        spec["model"] = args.draft_model or loaded
    llm = LLM(loaded=loaded, dtype=args.dtype, max_model_len=2048, kv_cache_memory=1 << 29,
              speculative_config=spec)
    if name.endswith("-halving"):
        llm.engine.engine_core.speculator.allocator = None  # the earlier k rule
    return llm


def run_round(args: argparse.Namespace, loaded: Any, prompts: list[str], max_tokens: list[int],
              methods: list[str], kinds: list[str]) -> dict[str, Any]:
    """One pass over ``args.batches``, each batch size running all ``methods`` (an engine
    each, new per batch size with ``--fresh-engine``) interleaved group by group, or one method
    after another with ``--sequential``; prints each cell, the speed-ups against "off" and
    their breakdown by task kind (``kinds[i]`` is prompt i's), and returns the cells by
    ``"METHOD/bB"``."""
    results: dict[str, Any] = {}
    llms: dict[str, LLM] = {}
    for b in args.batches:
        if not llms or args.fresh_engine:
            llms = {}  # the old engines go first: each holds its own KV pool
            llms = {name: make_llm(args, loaded, name) for name in methods}
        if args.sequential:
            cells = {name: run_batch(llm, prompts, max_tokens, b) for name, llm in llms.items()}
        else:
            cells = run_interleaved(llms, prompts, max_tokens, b)
        for name, r in cells.items():
            results[f"{name}/b{b}"] = r
            print(f"{name:6s} batch {b:3d}: TPOT {r['tpot_ms']:7.2f} ms, wall {r['wall_s']:6.1f} s, "
                  f"{r['tokens']} tokens, acceptance {r['acceptance_rate']:.2f}, mean accepted length "
                  f"{r['mean_accepted_length']:.2f}, per position {r['acceptance_per_pos']}")
            speculator = llms[name].engine.engine_core.speculator
            allocator = speculator and speculator.allocator
            if allocator is not None and allocator.learn_step_cost:
                table = " ".join(f"{rows}:{1000 * t:.1f}" for rows, t in allocator.step_cost.measured)
                print(f"       learned forward ms by rows: {table}")
    del llms
    for name in methods[1:]:
        for b in args.batches:
            off, on = results[f"off/b{b}"], results[f"{name}/b{b}"]
            same = off["outputs"] == on["outputs"]
            print(f"{name:6s} batch {b:3d}: speedup {off['tpot_ms'] / on['tpot_ms']:.2f}x TPOT; "
                  f"outputs identical to off: {same}")
            print_by_kind(name, b, off, on, kinds)
    return results


def run_sharegpt(args: argparse.Namespace, loaded: Any, tok: Any) -> dict[str, Any]:
    """ShareGPT at batch 64, speculation off against n-gram configured (which the policy turns
    off at this batch size): ``max(3, args.repeats)`` rounds on two engines, their order
    alternating, and the median TPOT of each (a single pass of each moved the ratio by 5 % on
    a quiet AMX Xeon: 0.95 once, 0.998 as the median of 5)."""
    sg = [{"prompt_token_ids": p} for p in sharegpt_prompts(tok, 64, 128)]
    llms = {}
    for method in ("off", "ngram"):
        spec = None if method == "off" else {"method": "ngram", "num_speculative_tokens": args.k}
        llms[method] = LLM(loaded=loaded, dtype=args.dtype, max_model_len=2048,
                           kv_cache_memory=1 << 29, speculative_config=spec)
    tpots: dict[str, list[float]] = {"off": [], "ngram": []}
    results: dict[str, Any] = {}
    for rnd in range(max(3, args.repeats)):
        for method in ("off", "ngram") if rnd % 2 == 0 else ("ngram", "off"):
            r = run_batch(llms[method], sg, [32] * 64, 64)
            tpots[method].append(r["tpot_ms"])
            results[f"sharegpt/round{rnd}/{method}"] = r
            print(f"sharegpt batch 64 {method:6s} round {rnd}: TPOT {r['tpot_ms']:.2f} ms, "
                  f"wall {r['wall_s']:.1f} s, acceptance {r['acceptance_rate']:.2f}")
    off, on = statistics.median(tpots["off"]), statistics.median(tpots["ngram"])
    print(f"sharegpt batch 64: ngram (policy off) / off TPOT speed ratio {off / on:.3f} "
          f"(median TPOT {on:.2f} against {off:.2f} ms)")
    return results


def print_by_kind(name: str, batch: int, off: dict[str, Any], on: dict[str, Any],
                  kinds: list[str]) -> None:
    """Where a cell's mean-TPOT speed-up comes from: the speed-up of each task kind (ratio of
    the kind's mean TPOTs), how many requests ran slower than off, and the ceiling of the
    figure if every such request had run exactly as fast as off. A request that drafts nothing
    cannot beat off (a step costs at least a plain one), so this ceiling bounds what a cheaper
    verification or a better policy could reach on this workload (docs/spec_decode.md)."""
    pairs = [(k, a, b) for k, a, b in zip(kinds, off["request_tpot_ms"], on["request_tpot_ms"],
                                          strict=True) if a is not None and b is not None]
    parts = []
    for kind in dict.fromkeys(kinds):
        mine = [(a, b) for k, a, b in pairs if k == kind]
        if mine:
            ratio = sum(a for a, _ in mine) / sum(b for _, b in mine)
            slower = sum(b > a for a, b in mine)
            parts.append(f"{kind} {ratio:.2f}x ({slower}/{len(mine)} slower)")
    ceiling = sum(a for _, a, _ in pairs) / sum(min(a, b) for _, a, b in pairs)
    print(f"{name:6s} batch {batch:3d}: by kind: {', '.join(parts)}; ceiling with no request "
          f"slower than off: {ceiling:.2f}x")


def loaded_dtype(loaded: Any) -> str:
    """The dtype of the loaded weights, e.g. ``bfloat16``."""
    return str(next(iter(loaded.state_dict.values())).dtype).replace("torch.", "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=32, help="repetitive requests per batch size")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--methods", nargs="+", default=["off", "ngram", "suffix"])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument(
        "--fresh-engine",
        action="store_true",
        help="a new engine for every batch size (the suffix proposer then starts each batch "
        "size with an empty cross-request cache instead of the answers of the one before)",
    )
    ap.add_argument("--sequential", action="store_true",
                    help="run each method's cell whole, one after another, instead of all methods "
                         "interleaved group by group (a group = --batches prompts)")
    ap.add_argument("--sharegpt", action="store_true", help="also batch 64 ShareGPT (policy off)")
    ap.add_argument("--dtype", default="auto", help="auto (default), float32 or bfloat16")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds over all methods, alternating them; prints the median speed-ups")
    ap.add_argument("--old-policy", action="store_true",
                    help="also run each n-gram / suffix method with the earlier per-sequence k "
                         "policy (grow after a full run, halve after a miss; no goodput rule), "
                         "as METHOD-halving, in the same process")
    ap.add_argument("--fixed-step-cost", action="store_true",
                    help="also run each n-gram / suffix method with the goodput rule on the prior "
                         "step cost model (learn_step_cost false), as METHOD-fixed")
    ap.add_argument("--draft-model", default=None,
                    help="draft of --methods draft_model (registry name or path); default: the "
                         "bundled SmolLM2 as its own draft (100%% greedy acceptance expected)")
    args = ap.parse_args()

    from pagedllm.config import EngineConfig

    loaded = load_model(None, EngineConfig(dtype=args.dtype).torch_dtype)
    tok = loaded.tokenizer
    tasks = build_repetitive_tasks(args.n, seed=0)
    prompts = build_repetitive_prompts(args.n, seed=0, tokenizer=tok)
    max_tokens = [min(args.max_tokens, len(tok(t.reference).input_ids)) for t in tasks]
    print(f"CPU threads: {torch.get_num_threads()}; dtype {loaded_dtype(loaded)}; {args.n} "
          "repetitive prompts, "
          f"prompt tokens mean {statistics.mean(len(tok(p).input_ids) for p in prompts):.0f}, "
          f"max_tokens mean {statistics.mean(max_tokens):.0f}")
    methods = list(args.methods)
    if args.old_policy:
        methods += [f"{m}-halving" for m in args.methods if m in ("ngram", "suffix")]
    if args.fixed_step_cost:
        methods += [f"{m}-fixed" for m in args.methods if m in ("ngram", "suffix")]
    rounds = []
    for rnd in range(args.repeats):
        if args.repeats > 1:
            print(f"-- round {rnd + 1} of {args.repeats}")
        rounds.append(run_round(args, loaded, prompts, max_tokens, methods,
                                [t.kind for t in tasks]))
    results = rounds[0]
    if args.repeats > 1:  # the machine's speed drifts between cells: the median round decides
        results = {f"round{i}/{key}": v for i, r in enumerate(rounds) for key, v in r.items()}
        for name in methods[1:]:
            for b in args.batches:
                ratios = [r[f"off/b{b}"]["tpot_ms"] / r[f"{name}/b{b}"]["tpot_ms"] for r in rounds]
                listed = ", ".join(f"{x:.2f}" for x in ratios)
                print(f"{name:6s} batch {b:3d}: median speedup {statistics.median(ratios):.2f}x "
                      f"TPOT over {len(ratios)} rounds ({listed})")
    if args.sharegpt:
        results.update(run_sharegpt(args, loaded, tok))
    if args.json:
        for r in results.values():
            r.pop("outputs", None)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
