"""Offline throughput of two pagedllm checkouts, alternating in one run (did a change cost speed?).

Each round runs pagedllm's side of ``vs_vllm.py`` (``--skip-vllm``, one round, its own process
with ``PYTHONPATH`` set to the checkout, so start-up and the C++ build are each checkout's own) for
both checkouts, alternating which goes first. It prints each run's output tokens/s, the medians
and the ratio new / old. Make the old checkout with ``git worktree add /tmp/old REV``.

    .venv/bin/python benchmarks/ab_revisions.py --old /tmp/old --new . --rounds 3 --workload a
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DATA_DIR, median  # noqa: E402


def run_checkout(checkout: Path, workload: str, extra: list[str]) -> float:
    """One ``vs_vllm.py --skip-vllm --rounds 1`` run of ``checkout``; returns its output tok/s.

    Raises:
        subprocess.CalledProcessError: when the run fails (its output is printed first).
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        env = dict(os.environ, PYTHONPATH=str(checkout), PAGEDLLM_DATA=str(DATA_DIR))
        cmd = [sys.executable, "benchmarks/vs_vllm.py", "--workload", workload, "--rounds", "1",
               "--skip-vllm", "--out", str(out), *extra]
        proc = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n")
            proc.check_returncode()
        return float(json.loads(out.read_text())[f"workload_{workload}"]["pagedllm_median_tok_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", type=Path, required=True, help="checkout of the old revision")
    ap.add_argument("--new", type=Path, default=Path("."), help="checkout of the new revision")
    ap.add_argument("--workload", choices=["a", "b"], default="a")
    ap.add_argument("--rounds", type=int, default=3)
    args, extra = ap.parse_known_args()
    runs: dict[str, list[float]] = {"old": [], "new": []}
    dirs = {"old": args.old.resolve(), "new": args.new.resolve()}
    # No bench_lock here: each vs_vllm.py run takes it itself while it measures.
    for r in range(args.rounds):
        order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
        for name in order:
            runs[name].append(run_checkout(dirs[name], args.workload, extra))
            print(f"round {r}: {name} {runs[name][-1]:7.1f} output tok/s", flush=True)
    old_med, new_med = median(runs["old"]), median(runs["new"])
    print(json.dumps({"old_tok_s": runs["old"], "new_tok_s": runs["new"], "old_median": old_med,
                      "new_median": new_med, "ratio_new_over_old": new_med / old_med}, indent=1))


if __name__ == "__main__":
    main()
