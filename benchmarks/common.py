"""Helpers shared by the benchmark scripts: data loading and the machine-noise etiquette."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

DATA_DIR = Path(
    os.environ.get("PAGEDLLM_DATA", Path(__file__).resolve().parents[1].parent / "shared" / "data")
)


def sharegpt_prompts(tokenizer, n: int, prompt_len: int) -> list[list[int]]:
    """``n`` prompts of exactly ``prompt_len`` tokens: first human turns of ShareGPT, truncated
    (turns shorter than ``prompt_len`` are skipped)."""
    records = json.loads((DATA_DIR / "sharegpt_1024.json").read_text())
    out: list[list[int]] = []
    for r in records:
        turns = r.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        ids = tokenizer(turns[0]["value"], add_special_tokens=False).input_ids
        if len(ids) >= prompt_len:
            out.append(ids[:prompt_len])
        if len(out) == n:
            return out
    raise RuntimeError(f"only {len(out)} ShareGPT prompts have >= {prompt_len} tokens")


def median(xs: list[float]) -> float:
    return statistics.median(xs)


LOCK = Path("/tmp/pagedllm_bench.lock")


@contextlib.contextmanager
def bench_lock() -> Iterator[None]:
    """Wait until no other benchmark holds the machine-wide lock file, then hold it while the
    block runs (timed measurements must not overlap on a 2-core machine)."""
    while True:
        try:
            fd = os.open(LOCK, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            break
        except FileExistsError:
            print(f"{LOCK} exists: another benchmark is running; waiting 15 s", flush=True)
            time.sleep(15)
    os.write(fd, f"{os.getpid()} {sys.argv[0]}\n".encode())
    os.close(fd)
    try:
        yield
    finally:
        LOCK.unlink(missing_ok=True)


def merge_json(path: str | Path, result: dict) -> None:
    """Write ``result`` to ``path``, keeping keys of an earlier run that this run skipped."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        old = json.loads(out.read_text())
        old.update(result)
        result = old
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
