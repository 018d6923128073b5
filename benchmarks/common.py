"""Helpers shared by the benchmark scripts: data loading and the machine-noise etiquette."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import statistics
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
    """Hold the machine-wide lock ``/tmp/pagedllm_bench.lock`` (``flock``) while the block runs,
    waiting for any other holder first: timed measurements and heavy jobs must not overlap on a
    2-core machine. Shell jobs take the same lock with ``flock /tmp/pagedllm_bench.lock CMD``."""
    fd = os.open(LOCK, os.O_CREAT | os.O_WRONLY, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"{LOCK} is held by another job; waiting", flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


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


def sharegpt_requests(
    tokenizer, n: int, max_prompt: int = 1024, max_total: int = 2048, min_len: int = 4
) -> list[tuple[list[int], int]]:
    """The first ``n`` usable ShareGPT records as (prompt token ids, reference output length):
    prompt = first human turn, output length = the first reply's token count (paper section 6.1).
    Records with a prompt over ``max_prompt`` tokens, prompt + output over ``max_total``, or
    either under ``min_len`` are skipped.

    Raises:
        RuntimeError: fewer than ``n`` records qualify.
    """
    records = json.loads((DATA_DIR / "sharegpt_1024.json").read_text())
    out: list[tuple[list[int], int]] = []
    for r in records:
        turns = r.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human":
            continue
        prompt = tokenizer(turns[0]["value"], add_special_tokens=False).input_ids
        n_out = len(tokenizer(turns[1]["value"], add_special_tokens=False).input_ids)
        if min(len(prompt), n_out) < min_len or len(prompt) > max_prompt:
            continue
        if len(prompt) + n_out > max_total:
            continue
        out.append((prompt, n_out))
        if len(out) == n:
            return out
    raise RuntimeError(f"only {len(out)} ShareGPT records qualify (wanted {n})")


def alpaca_requests(tokenizer, n: int, min_len: int = 4) -> list[tuple[list[int], int]]:
    """The first ``n`` Alpaca records as (prompt token ids, reference output length): prompt =
    instruction, plus a newline and the input when there is one; output length = the reference
    output's token count (paper section 6.1). Records with either under ``min_len`` are skipped.

    Raises:
        RuntimeError: fewer than ``n`` records qualify.
    """
    records = json.loads((DATA_DIR / "alpaca_2000.json").read_text())
    out: list[tuple[list[int], int]] = []
    for r in records:
        text = r["instruction"] + (("\n" + r["input"]) if r.get("input") else "")
        prompt = tokenizer(text, add_special_tokens=False).input_ids
        n_out = len(tokenizer(r["output"], add_special_tokens=False).input_ids)
        if min(len(prompt), n_out) < min_len:
            continue
        out.append((prompt, n_out))
        if len(out) == n:
            return out
    raise RuntimeError(f"only {len(out)} Alpaca records qualify (wanted {n})")
