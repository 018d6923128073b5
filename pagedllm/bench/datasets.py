"""Benchmark workloads: prompts and output lengths as in the paper (section 6.1, figure 11).

- **ShareGPT**: prompt = the first human turn of a conversation, output length = the token count
  of the reply that follows it (the engine is asked for exactly that many tokens, ``ignore_eos``).
- **Alpaca**: prompt = instruction (+ a blank line and the input, when there is one), output
  length = the token count of the reference output.
- **WMT16** (en -> de): a k-shot translation prompt ("English: ...\\nGerman: ..." examples, then
  "English: <sentence>\\nGerman:"), output length = the token count of the reference German.
- **random**: random token ids of a given input length, a given output length.

Records whose prompt or reference output is shorter than ``min_len`` tokens (default 4) are
dropped (degenerate conversations), as are those with a prompt over ``max_prompt_len`` tokens or
prompt + output over ``max_model_len`` tokens (they could not be served).

The file of a dataset is ``dataset_path`` when given (``--dataset-path``, as vLLM's bench),
else ``FILES[name]`` in ``data_dir``: ``$PAGEDLLM_DATA``, else ``../shared/data`` next to the
repository (the development environment's samples). ``SOURCES`` says where each file comes from:
ShareGPT is vLLM's ``ShareGPT_V3_unfiltered_cleaned_split.json``, Alpaca the Stanford Alpaca
``alpaca_data.json``; ``random`` needs no file.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATASETS = ("sharegpt", "alpaca", "wmt16", "random")
FILES = {
    "sharegpt": "sharegpt_1024.json",
    "alpaca": "alpaca_2000.json",
    "wmt16": "wmt16_en_de.json",
}
# Where a user without the development environment's samples gets each file (--dataset-path).
SOURCES = {
    "sharegpt": "ShareGPT_V3_unfiltered_cleaned_split.json, the ShareGPT file of vLLM's "
    "benchmarks, from the Hugging Face dataset anon8231489123/ShareGPT_Vicuna_unfiltered "
    '(a JSON list of {"conversations": [{"from": "human", "value": ...}, '
    '{"from": "gpt", "value": ...}]})',
    "alpaca": "alpaca_data.json of the Stanford Alpaca repository (tatsu-lab/stanford_alpaca "
    'on GitHub; a JSON list of {"instruction", "input", "output"})',
    "wmt16": 'a JSON list of {"en": ..., "de": ...} sentence pairs, e.g. WMT16 newstest2016 '
    "English-German",
}


def default_data_dir() -> Path:
    """``$PAGEDLLM_DATA``, else ``<repository>/../shared/data``."""
    env = os.environ.get("PAGEDLLM_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


def dataset_file(
    name: str, dataset_path: str | Path | None = None, data_dir: str | Path | None = None
) -> Path:
    """The JSON file of dataset ``name``: ``dataset_path`` when given, else ``FILES[name]`` in
    ``data_dir`` (default ``default_data_dir()``).

    Raises:
        FileNotFoundError: when the file is missing; the message says where to get it.
    """
    path = Path(dataset_path or Path(data_dir or default_data_dir()) / FILES[name])
    if not path.is_file():
        raise FileNotFoundError(
            f"{name} data not found: {path}. Pass --dataset-path FILE (dataset_path=) with "
            f"{SOURCES[name]}, or set PAGEDLLM_DATA to a folder holding {FILES[name]}; "
            "--dataset random needs no file"
        )
    return path


@dataclass
class BenchRequest:
    """One benchmark request.

    Attributes:
        prompt: text, or token ids (the ``random`` dataset).
        prompt_len: prompt tokens (with the benchmark's tokenizer).
        output_len: output tokens to ask for (``max_tokens``, with ``ignore_eos``).
    """

    prompt: str | list[int]
    prompt_len: int
    output_len: int


Tokenize = Callable[[str], list[int]]


def _pairs(name: str, records: list[dict[str, Any]], shots: int) -> Iterable[tuple[str, str]]:
    """(prompt text, reference output text) of every usable record, in file order."""
    if name == "sharegpt":
        for r in records:
            turns = r.get("conversations") or []
            if (
                len(turns) >= 2
                and turns[0].get("from") == "human"
                and turns[1].get("from") == "gpt"
            ):
                yield turns[0]["value"], turns[1]["value"]
    elif name == "alpaca":
        for r in records:
            text = r["instruction"] + ("\n\n" + r["input"] if r.get("input") else "")
            yield text, r["output"]
    else:  # wmt16: the first `shots` pairs form the prefix of every prompt
        prefix = "".join(f"English: {r['en']}\nGerman: {r['de']}\n\n" for r in records[:shots])
        for r in records[shots:]:
            yield f"{prefix}English: {r['en']}\nGerman:", r["de"]


def load_dataset(
    name: str,
    tokenize: Tokenize,
    num_requests: int,
    *,
    data_dir: str | Path | None = None,
    dataset_path: str | Path | None = None,
    seed: int = 0,
    shuffle: bool = True,
    min_len: int = 4,
    max_prompt_len: int = 1024,
    max_model_len: int = 2048,
    max_output_len: int | None = None,
    wmt_shots: int = 1,
    input_len: int = 128,
    output_len: int = 128,
    vocab_size: int = 32000,
) -> list[BenchRequest]:
    """``num_requests`` requests of a workload.

    Args:
        name: "sharegpt", "alpaca", "wmt16" or "random".
        tokenize: text -> token ids (no special tokens), for the lengths.
        num_requests: how many requests (all usable records if fewer exist).
        data_dir: folder of the JSON files under their ``FILES`` names (default
            ``default_data_dir()``).
        dataset_path: the JSON file itself (wins over ``data_dir``).
        seed: order of the records when ``shuffle`` (a sample of the file, reproducible).
        shuffle: sample records in a seeded random order instead of file order.
        min_len / max_prompt_len / max_model_len: the filters of the module docstring (tokens).
        max_output_len: cap the output length (tokens; None = the reference length).
        wmt_shots: examples in the WMT16 translation prefix.
        input_len / output_len / vocab_size: the ``random`` dataset's lengths and id range.

    Raises:
        ValueError: naming the field: an unknown ``name``, ``num_requests`` < 1, bad lengths.
        FileNotFoundError: when the dataset file is missing; the message says where to get it.
    """
    if name not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, got {name!r}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if name == "random":
        if input_len < 1 or output_len < 1:
            raise ValueError(
                f"input_len and output_len must be >= 1, got {input_len}, {output_len}"
            )
        rng = random.Random(seed)
        return [
            BenchRequest(
                [rng.randrange(vocab_size) for _ in range(input_len)], input_len, output_len
            )
            for _ in range(num_requests)
        ]
    if wmt_shots < 0:
        raise ValueError(f"wmt_shots must be >= 0, got {wmt_shots}")
    path = dataset_file(name, dataset_path, data_dir)
    records = json.loads(path.read_text())
    pairs = list(_pairs(name, records, wmt_shots))
    if shuffle:
        random.Random(seed).shuffle(pairs)
    out: list[BenchRequest] = []
    for prompt, reference in pairs:
        p_len = len(tokenize(prompt))
        o_len = len(tokenize(reference))
        if p_len < min_len or o_len < min_len:
            continue
        if max_output_len is not None:
            o_len = min(o_len, max_output_len)
        if p_len > max_prompt_len or p_len + o_len > max_model_len:
            continue
        out.append(BenchRequest(prompt, p_len, o_len))
        if len(out) == num_requests:
            break
    return out


def hf_tokenize(tokenizer: Any) -> Tokenize:
    """A ``Tokenize`` from a transformers tokenizer (no BOS / special tokens added)."""

    def tok(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False).input_ids)

    return tok


def workload_stats(reqs: list[BenchRequest]) -> dict[str, float]:
    """Mean / max prompt and output lengths in tokens (the paper's figure 11 summary)."""
    if not reqs:
        return {"num_requests": 0}
    p = [r.prompt_len for r in reqs]
    o = [r.output_len for r in reqs]
    return {
        "num_requests": len(reqs),
        "mean_prompt_len": sum(p) / len(p),
        "mean_output_len": sum(o) / len(o),
        "max_prompt_len": max(p),
        "max_output_len": max(o),
    }
