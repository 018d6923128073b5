"""Helpers shared by the benchmark scripts: data loading and the machine-noise etiquette."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import statistics
from collections.abc import Iterator
from pathlib import Path

from pagedllm.bench.datasets import dataset_file, default_data_dir

# Where the scripts read the dataset samples: $PAGEDLLM_DATA, else ../shared/data (see
# pagedllm.bench.datasets: SOURCES says where each file comes from on a fresh clone).
DATA_DIR = default_data_dir()


def _sharegpt_turns(
    tokenizer, n: int, turn: int, role: str, min_tokens: int, max_tokens: int, newest_first: bool
) -> list[list[int]]:
    """Token ids (no special tokens) of ``n`` ShareGPT conversations' turn ``turn`` when it is
    from ``role`` and has >= ``min_tokens`` tokens, each cut to ``max_tokens``.

    Raises:
        RuntimeError: fewer than ``n`` such turns exist.
    """
    records = json.loads(dataset_file("sharegpt", data_dir=DATA_DIR).read_text())
    out: list[list[int]] = []
    for r in reversed(records) if newest_first else records:
        turns = r.get("conversations") or []
        if len(turns) <= turn or turns[turn].get("from") != role:
            continue
        ids = tokenizer(turns[turn]["value"], add_special_tokens=False).input_ids
        if len(ids) >= min_tokens:
            out.append(ids[:max_tokens])
        if len(out) == n:
            return out
    raise RuntimeError(f"only {len(out)} ShareGPT {role} turns have >= {min_tokens} tokens")


def sharegpt_prompts(tokenizer, n: int, prompt_len: int) -> list[list[int]]:
    """``n`` prompts of exactly ``prompt_len`` tokens: first human turns of ShareGPT, truncated
    (turns shorter than ``prompt_len`` are skipped)."""
    return _sharegpt_turns(tokenizer, n, 0, "human", prompt_len, prompt_len, newest_first=False)


def held_out_texts(tokenizer, n: int, min_tokens: int, max_tokens: int) -> list[list[int]]:
    """Token ids of the last ``n`` ShareGPT replies with >= ``min_tokens`` tokens, each cut to
    ``max_tokens`` (BOS-free, as the reply text tokenizes)."""
    return _sharegpt_turns(tokenizer, n, 1, "gpt", min_tokens, max_tokens, newest_first=True)


def cpu_description() -> str:
    """One line naming this CPU for benchmark output: the ``model name`` of /proc/cpuinfo with
    its ``cpu family`` / ``model`` numbers (a VM often shows only "AMD EPYC": family 25 is Zen 3
    / Zen 4, 26 is Zen 5), the ISA flags pagedllm dispatches on (avx2 / avx512* / amx*,
    :func:`pagedllm.platform.cpu_flags`) and the core count, e.g. ``AMD EPYC (family 26 model 2)
    | flags: avx2 fma f16c avx512f ... | 2 cores``."""
    from pagedllm.platform import cpu_flags

    fields: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            key, sep, value = line.partition(":")
            if not sep:
                break  # the end of the first processor's block
            fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name", "unknown CPU")
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']} model {fields['model']})"
    return f"{name} | flags: {cpu_flags().summary()} | {os.cpu_count()} cores"


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


def dataset_requests(tokenizer, name: str, n: int) -> list[tuple[list[int], int]]:
    """The first ``n`` usable records of ``name`` ("sharegpt" or "alpaca") in file order, as
    (prompt token ids, reference output length), with ``pagedllm.bench.datasets``' rules (paper
    section 6.1: ShareGPT prompt = first human turn, Alpaca prompt = instruction + input; output
    length = the reference answer's token count; prompts over 1024 tokens, prompt + output over
    2048, or either under 4 tokens are skipped).

    Raises:
        RuntimeError: fewer than ``n`` records qualify.
    """
    from pagedllm.bench.datasets import hf_tokenize, load_dataset

    tok = hf_tokenize(tokenizer)
    reqs = load_dataset(name, tok, n, data_dir=DATA_DIR, shuffle=False)
    if len(reqs) < n:
        raise RuntimeError(f"only {len(reqs)} {name} records qualify (wanted {n})")
    return [(r.prompt if isinstance(r.prompt, list) else tok(r.prompt), r.output_len) for r in reqs]
