"""Memory sharing (paper figure 15) and shared-prefix throughput (paper figure 16).

(a) Figure 15: KV memory saved by sharing blocks between the sequences of one request, on
    ``--alpaca-prompts`` Alpaca records (raw text: instruction, blank line, input). Each request
    asks for exactly its reference output length in tokens (capped at ``--max-output``):
    parallel sampling with n = 2, 4, 6 (temperature 1, ignore_eos) and beam search with width
    2, 4, 6 (ignore_eos). The metric is ``EngineStats.sharing_saving``: 1 - blocks in use /
    blocks the same sequences would hold without sharing, averaged over engine steps. Prefix
    caching is off here so only within-request sharing counts. This is a block count, not a
    timing, so it does not take the lock. ``--sharegpt`` adds the same on ShareGPT prompts.
(b) Figure 16: ``--wmt-sentences`` WMT16 en->de sentences, each behind a 1-shot or 5-shot prefix
    of example translations ("English: ...\\nGerman: ...") and followed by
    "English: <sentence>\\nGerman:", greedy, exactly ``--wmt-output`` tokens (ignore_eos), with
    ``enable_prefix_caching`` on vs off (a fresh engine per run, so the cache starts cold).
    On/off alternate for ``--rounds`` rounds; the median output tokens/s is reported with the
    share of prompt tokens served from the prefix cache. Timed parts hold the machine-wide
    benchmark lock (common.bench_lock).

Prints tables, writes benchmarks/results/sharing.json and docs/figures/fig15_sharing.png,
docs/figures/fig16_prefix.png.

    .venv/bin/python benchmarks/sharing.py                      # defaults: ~3-5 min on 2 cores
    .venv/bin/python benchmarks/sharing.py --alpaca-prompts 32 --sharegpt --rounds 3
"""

from __future__ import annotations

import pagedllm  # noqa: F401 (first: it sets OpenMP's barrier spin before torch loads libgomp)

# isort: split
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DATA_DIR, bench_lock, median, merge_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


# ---- (a) figure 15 -----------------------------------------------------------------------------
def alpaca_workload(tok, n: int, max_output: int) -> list[tuple[list[int], int]]:
    records = json.loads((DATA_DIR / "alpaca_2000.json").read_text())
    out = []
    for r in records:
        text = r["instruction"] + ("\n\n" + r["input"] if r.get("input") else "")
        ids = tok(text, add_special_tokens=False).input_ids
        olen = len(tok(r["output"], add_special_tokens=False).input_ids)
        if not ids or olen < 1:
            continue
        out.append((ids, min(olen, max_output)))
        if len(out) == n:
            break
    return out


def sharegpt_workload(tok, n: int, max_prompt: int, max_output: int) -> list[tuple[list[int], int]]:
    records = json.loads((DATA_DIR / "sharegpt_1024.json").read_text())
    out = []
    for r in records:
        turns = r.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human":
            continue
        ids = tok(turns[0]["value"], add_special_tokens=False).input_ids[:max_prompt]
        olen = len(tok(turns[1]["value"], add_special_tokens=False).input_ids)
        if not ids or olen < 1:
            continue
        out.append((ids, min(olen, max_output)))
        if len(out) == n:
            break
    return out


def sharing_saving(loaded, workload, kind: str, k: int, block_size: int) -> dict:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    max_len = max(len(p) + o for p, o in workload) + 8
    llm = LLM(
        loaded=loaded,
        block_size=block_size,
        enable_prefix_caching=False,
        max_model_len=max_len,
        max_num_seqs=256,
    )
    params = []
    for i, (_, olen) in enumerate(workload):
        if kind == "parallel":
            params.append(
                SamplingParams(n=k, temperature=1.0, max_tokens=olen, ignore_eos=True, seed=i)
            )
        else:
            params.append(
                SamplingParams(
                    n=k,
                    best_of=k,
                    use_beam_search=True,
                    temperature=0.0,
                    max_tokens=olen,
                    ignore_eos=True,
                )
            )
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p, _ in workload], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    st = llm.engine.stats
    return {
        "kind": kind,
        "k": k,
        "saving_pct": 100.0 * st.sharing_saving,
        "blocks_used_mean": st.blocks_used_sum / max(st.num_steps, 1),
        "blocks_unshared_mean": st.blocks_unshared_sum / max(st.num_steps, 1),
        "steps": st.num_steps,
        "preemptions": st.num_preemptions,
        "seconds": dt,
    }


# ---- (b) figure 16 -----------------------------------------------------------------------------
def wmt_workload(tok, shots: int, n: int) -> tuple[list[list[int]], list[int]]:
    """Prompts of a ``shots``-shot translation prefix plus one sentence each; returns the
    prompts' token ids and the prefix's."""
    records = json.loads((DATA_DIR / "wmt16_en_de.json").read_text())
    # Examples: the first records of moderate length (so 1-shot ~ tens of tokens).
    examples = [r for r in records if 8 <= len(r["en"].split()) <= 30][:shots]
    prefix = "Translate English to German.\n\n" + "".join(
        f"English: {r['en']}\nGerman: {r['de']}\n\n" for r in examples
    )
    used = {r["id"] for r in examples}
    sentences = [
        r["en"] for r in records if r["id"] not in used and 4 <= len(r["en"].split()) <= 40
    ]
    # Prefix and sentence are tokenized apart and joined, so every prompt starts with exactly the
    # same prefix ids (a joint tokenization could merge tokens across the boundary).
    prefix_ids = tok(prefix, add_special_tokens=False).input_ids
    prompts = [
        prefix_ids + tok(f"English: {s}\nGerman:", add_special_tokens=False).input_ids
        for s in sentences[:n]
    ]
    return prompts, prefix_ids


def prefix_run(
    loaded, prompts, prefix_ids, output_len: int, caching: bool, block_size: int
) -> dict:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    llm = LLM(
        loaded=loaded,
        block_size=block_size,
        enable_prefix_caching=caching,
        max_model_len=max(len(p) for p in prompts) + output_len + 8,
    )
    # Untimed warm-up on the prefix alone: as in the paper's setup, the shared prefix is in the
    # cache before the workload starts (with caching on; with it off this only warms up). Without
    # it, requests admitted in the same step would all compute the prefix themselves.
    llm.generate([{"prompt_token_ids": prefix_ids}], SamplingParams(max_tokens=1), use_tqdm=False)
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    prompt_tokens = sum(len(p) for p in prompts)
    cached = sum(o.num_cached_tokens for o in outs)
    return {
        "tok_s": len(prompts) * output_len / dt,
        "seconds": dt,
        "cached_share": cached / prompt_tokens,
        "prompt_tokens_computed": llm.engine.stats.prompt_tokens,
    }


# ---- figures -----------------------------------------------------------------------------------
def plot_fig15(rows_by_data: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, kind, title in zip(
        axes, ("parallel", "beam"), ("Parallel sampling", "Beam search"), strict=True
    ):
        names = list(rows_by_data)
        width = 0.8 / len(names)
        for j, name in enumerate(names):
            rows = [r for r in rows_by_data[name] if r["kind"] == kind]
            xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(rows))]
            bars = ax.bar(xs, [r["saving_pct"] for r in rows], width, label=name)
            ax.bar_label(bars, fmt="%.1f", fontsize=8)
            ax.set_xticks(range(len(rows)), [str(r["k"]) for r in rows])
        ax.set_xlabel("# output sequences" if kind == "parallel" else "beam width")
        ax.set_ylabel("memory saving (%)")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle("KV block sharing: memory saving (SmolLM2-135M, pagedllm)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_fig16(prefix_rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    labels = [f"{r['shots']}-shot\n(prefix {r['prefix_tokens']} tok)" for r in prefix_rows]
    xs = range(len(prefix_rows))
    off = ax.bar(
        [x - 0.2 for x in xs],
        [r["off_median_tok_s"] for r in prefix_rows],
        0.4,
        label="prefix caching off",
    )
    on = ax.bar(
        [x + 0.2 for x in xs],
        [r["on_median_tok_s"] for r in prefix_rows],
        0.4,
        label="prefix caching on",
    )
    ax.bar_label(off, fmt="%.0f", fontsize=8)
    ax.bar_label(on, fmt="%.0f", fontsize=8)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("output tokens/s")
    ax.set_title("Shared-prefix translation (WMT16 en-de), median of rounds", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--alpaca-prompts", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=64, help="cap on the reference output length")
    ap.add_argument("--widths", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--sharegpt", action="store_true", help="also run figure 15 on ShareGPT")
    ap.add_argument("--sharegpt-prompts", type=int, default=8)
    ap.add_argument("--sharegpt-max-prompt", type=int, default=256)
    ap.add_argument("--wmt-sentences", type=int, default=48)
    ap.add_argument("--wmt-output", type=int, default=32)
    ap.add_argument("--shots", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-fig15", action="store_true")
    ap.add_argument("--skip-fig16", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/sharing.json"))
    args = ap.parse_args()

    from pagedllm.model.loader import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(None)
    tok = loaded.tokenizer
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args)}

    if not args.skip_fig15:
        datasets = {"Alpaca": alpaca_workload(tok, args.alpaca_prompts, args.max_output)}
        if args.sharegpt:
            datasets["ShareGPT"] = sharegpt_workload(
                tok, args.sharegpt_prompts, args.sharegpt_max_prompt, args.max_output
            )
        fig15: dict[str, list[dict]] = {}
        for name, wl in datasets.items():
            mean_in = sum(len(p) for p, _ in wl) / len(wl)
            mean_out = sum(o for _, o in wl) / len(wl)
            print(
                f"\nFigure 15 - {name}: {len(wl)} prompts, mean {mean_in:.1f} in / "
                f"{mean_out:.1f} out tokens, block size {args.block_size}",
                flush=True,
            )
            print(f"{'workload':<22}{'saving %':>9}{'used blk':>10}{'unshared':>10}{'s':>7}")
            rows = []
            for kind in ("parallel", "beam"):
                for k in args.widths:
                    r = sharing_saving(loaded, wl, kind, k, args.block_size)
                    rows.append(r)
                    label = f"{'parallel n' if kind == 'parallel' else 'beam width'}={k}"
                    print(
                        f"{label:<22}{r['saving_pct']:9.1f}{r['blocks_used_mean']:10.1f}"
                        f"{r['blocks_unshared_mean']:10.1f}{r['seconds']:7.1f}",
                        flush=True,
                    )
            fig15[name] = rows
            result[f"fig15_{name.lower()}"] = {
                "num_prompts": len(wl),
                "mean_input_tokens": mean_in,
                "mean_output_tokens": mean_out,
                "rows": rows,
            }
        plot_fig15(fig15, ROOT / "docs/figures/fig15_sharing.png")
        print("wrote docs/figures/fig15_sharing.png")

    if not args.skip_fig16:
        prefix_rows = []
        workloads = {s: wmt_workload(tok, s, args.wmt_sentences) for s in args.shots}
        print(
            f"\nFigure 16 - WMT16 en-de: {args.wmt_sentences} sentences, {args.wmt_output} "
            f"output tokens, greedy, {args.rounds} rounds (on/off alternating)",
            flush=True,
        )
        with bench_lock():
            for shots, (prompts, prefix_ids) in workloads.items():
                on, off = [], []
                for rnd in range(args.rounds):
                    # Alternate which goes first, so drift on the shared machine hits both.
                    order = (True, False) if rnd % 2 == 0 else (False, True)
                    for caching in order:
                        r = prefix_run(
                            loaded, prompts, prefix_ids, args.wmt_output, caching, args.block_size
                        )
                        (on if caching else off).append(r)
                        print(
                            f"  {shots}-shot round {rnd} caching {'on ' if caching else 'off'}: "
                            f"{r['tok_s']:6.1f} tok/s, cached {100 * r['cached_share']:.1f}% of "
                            f"prompt tokens",
                            flush=True,
                        )
                mean_prompt = sum(len(p) for p in prompts) / len(prompts)
                prefix_rows.append(
                    {
                        "shots": shots,
                        "prefix_tokens": len(prefix_ids),
                        "mean_prompt_tokens": mean_prompt,
                        "on_tok_s": [r["tok_s"] for r in on],
                        "off_tok_s": [r["tok_s"] for r in off],
                        "on_median_tok_s": median([r["tok_s"] for r in on]),
                        "off_median_tok_s": median([r["tok_s"] for r in off]),
                        "cached_share": on[0]["cached_share"],
                        "prompt_tokens_computed_on": on[0]["prompt_tokens_computed"],
                        "prompt_tokens_computed_off": off[0]["prompt_tokens_computed"],
                    }
                )
        print(
            f"\n{'prefix':<8}{'prefix tok':>11}{'prompt tok':>11}{'off tok/s':>11}"
            f"{'on tok/s':>10}{'speedup':>9}{'cached %':>10}"
        )
        for r in prefix_rows:
            r["speedup"] = r["on_median_tok_s"] / r["off_median_tok_s"]
            print(
                f"{str(r['shots']) + '-shot':<8}{r['prefix_tokens']:11d}"
                f"{r['mean_prompt_tokens']:11.1f}{r['off_median_tok_s']:11.1f}"
                f"{r['on_median_tok_s']:10.1f}{r['speedup']:9.2f}"
                f"{100 * r['cached_share']:10.1f}"
            )
        result["fig16"] = {
            "num_sentences": args.wmt_sentences,
            "output_len": args.wmt_output,
            "rows": prefix_rows,
        }
        plot_fig16(prefix_rows, ROOT / "docs/figures/fig16_prefix.png")
        print("wrote docs/figures/fig16_prefix.png")

    merge_json(args.out, result)


if __name__ == "__main__":
    main()
