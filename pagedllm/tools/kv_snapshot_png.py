"""Save the KV block map of a run as a PNG: the dashboard's grid, drawn with matplotlib.

Runs a workload on the engine, stops after ``--step`` steps, takes ``kv_snapshot(engine)`` and
draws one square per physical block: colored by the request that owns it, filled from the bottom
in proportion to the tokens it holds, outlined thick when shared (reference count > 1, the number
is printed), hatched when it is in the prefix cache; free blocks are light grey.

    .venv/bin/python -m pagedllm.tools.kv_snapshot_png --step 12 --out docs/kv-block-map.png

The default workload is the docs picture: requests with parallel sampling (n = 4 and n = 2) whose
prompts share a system-prompt prefix, on the bundled model, block size 16.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

SYSTEM = (
    "You are a careful assistant. Answer in short, plain sentences and explain your reasoning "
    "step by step when the question asks for it."
)
QUESTIONS = ["Why is the sky blue?", "Name three rivers in Europe.", "What is a block table?"]


def draw_block_map(snapshot: dict[str, Any], path: str, title: str = "") -> None:
    """Render ``snapshot["blocks"]`` (per-block columns, not aggregated) to a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    blocks = snapshot["blocks"]
    cfg = snapshot["config"]
    n = cfg["num_blocks"]
    bs = cfg["block_size"]
    states = blocks.get("state_names", ["free", "used", "used_cached", "evictable"])
    cols = max(8, math.ceil(math.sqrt(n * 2)))
    rows = math.ceil(n / cols)
    fig, ax = plt.subplots(figsize=(min(16, cols * 0.45 + 1), rows * 0.45 + 1.6))
    cmap = plt.get_cmap("tab10")
    requests = snapshot["requests"]
    for b in range(n):
        r, c = divmod(b, cols)
        x, y = c, rows - 1 - r
        state = states[blocks["state"][b]]
        owner = blocks["owner_request"][b]
        rc = blocks["ref_count"][b]
        color = "#eeeeee" if owner < 0 else cmap(owner % 10)
        ax.add_patch(
            Rectangle(
                (x + 0.05, y + 0.05), 0.9, 0.9, facecolor="white", edgecolor="#999999", lw=0.5
            )
        )
        if owner >= 0 or state == "evictable":
            fill = blocks["filled"][b] / bs
            ax.add_patch(
                Rectangle(
                    (x + 0.05, y + 0.05),
                    0.9,
                    0.9 * fill,
                    facecolor=color if owner >= 0 else "#cccccc",
                    lw=0,
                )
            )
        if state in ("used_cached", "evictable"):
            ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, fill=False, hatch="///", lw=0))
        if rc > 1:
            ax.add_patch(
                Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, fill=False, edgecolor="black", lw=2)
            )
            ax.text(x + 0.5, y + 0.5, str(rc), ha="center", va="center", fontsize=7, weight="bold")
    handles = [Rectangle((0, 0), 1, 1, facecolor=cmap(i % 10)) for i in range(len(requests))]
    labels = [f"{q['request_id']} (n={q['n']}, {q['state']})" for q in requests]
    handles += [
        Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="black", lw=2),
        Rectangle((0, 0), 1, 1, facecolor="white", hatch="///"),
    ]
    labels += ["shared (ref count)", "in prefix cache"]
    ax.legend(
        handles,
        labels,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.02),
        ncol=4,
        fontsize=7,
        frameon=False,
    )
    ctr = snapshot["counters"]
    ax.set_title(
        title
        or (
            f"KV block map: {ctr['blocks_used']} of {n} blocks used, {ctr['blocks_shared']} shared, "
            f"useful-token fraction {100 * ctr['useful_token_fraction']:.1f}%"
        ),
        fontsize=9,
    )
    ax.set_xlim(0, cols)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--step", type=int, default=12, help="engine steps before the snapshot")
    ap.add_argument("--out", default="docs/kv-block-map.png")
    ap.add_argument("--num-blocks", type=int, default=96)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args(argv)

    from pagedllm.engine.kv_snapshot import kv_snapshot
    from pagedllm.entrypoints.llm import LLM, apply_chat_template
    from pagedllm.sampling_params import SamplingParams

    llm = LLM(
        block_size=args.block_size, num_gpu_blocks_override=args.num_blocks, max_model_len=512
    )
    eng = llm.engine
    tok = llm.get_tokenizer()
    for i, q in enumerate(QUESTIONS):
        ids = apply_chat_template(
            tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        )
        n = 4 if i == 0 else 2
        eng.add_request(
            f"req-{i}", ids, SamplingParams(n=n, temperature=0.8, seed=i, max_tokens=64)
        )
    for _ in range(args.step):
        if not eng.has_unfinished_requests():
            break
        eng.step()
    snap = kv_snapshot(eng, max_cells=10**9)
    draw_block_map(snap, args.out)
    print(f"wrote {args.out} after {args.step} steps")
    for rid in list(eng.requests):
        eng.abort_request(rid)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
