"""A workload whose answers repeat their inputs (editing, extraction, reformatting), for the
speculative-decoding benchmark (issue 25): n-gram / suffix proposers shine when the output copies
long spans of the prompt.

How it is built, from the samples in ``../shared/data`` (``$PAGEDLLM_DATA``; see its README):

- **fix typos** (editing): an Alpaca reference output of 40-160 words; about one word in eight
  (at least one) of 4+ letters gets a typo (two adjacent letters swapped, a letter dropped or a
  letter doubled, chosen by the seeded RNG). Prompt: "Rewrite the following text, fixing the
  typos. Output only the corrected text." + the damaged passage; reference answer: the
  original passage.
- **extract** (extraction): a lowercase word X of 5+ letters that occurs in 3+ WMT16 English
  sentences; 3 sentences containing X and 5 that do not, shuffled into one passage. Prompt:
  "Extract all sentences that mention "X", one per line."; reference: the 3 sentences.
- **to JSON** (reformatting): 4 WMT16 English-German pairs as a "- English: ... | German: ..."
  list. Prompt: "Convert this list to JSON: an array of objects with keys "en" and "de"";
  reference: that JSON (``json.dumps(..., ensure_ascii=False, indent=1)``).
- **bullets** (reformatting): an Alpaca reference output of 2+ sentences and 40-160 words.
  Prompt: "Rewrite the following text as a bulleted list, one sentence per bullet, keeping the
  wording."; reference: the bullets.

Kinds rotate (request ``i`` has kind ``i % 4``); records are drawn by ``random.Random(seed)``,
so ``(n, seed)`` always gives the same prompts. The prompts are single-turn chats for the bundled
SmolLM2-135M-Instruct: :func:`build_repetitive_prompts` renders them with its chat template
(generation prompt added). ``len(reference)`` in tokens is the natural ``max_tokens`` (as the
paper does for ShareGPT).

Run ``PYTHONPATH=. python benchmarks/spec_workload.py [--n 8] [--seed 0]`` to print a few
prompts with their token counts.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections import defaultdict
from dataclasses import dataclass
from functools import cache
from typing import Any

from pagedllm.bench.datasets import dataset_file

KINDS = ("fix_typos", "extract", "to_json", "bullets")
_SENTENCE_END = re.compile(r"(?<=[a-z][.!?])\s+(?=[A-Z])")  # not after a list number ("1.")


@dataclass(frozen=True)
class RepetitiveTask:
    """One request of the workload.

    Attributes:
        kind: one of :data:`KINDS`.
        message: the user message (instruction + the text to work on).
        reference: a correct answer; it repeats most of the message's text.
    """

    kind: str
    message: str
    reference: str


@cache
def _alpaca_passages() -> tuple[str, ...]:
    records = json.loads(dataset_file("alpaca").read_text())
    out = []
    for r in records:
        text = " ".join(r["output"].split())
        if 40 <= len(text.split()) <= 160 and text.isascii():
            out.append(text)
    return tuple(out)


@cache
def _wmt_pairs() -> tuple[tuple[str, str], ...]:
    records = json.loads(dataset_file("wmt16").read_text())
    return tuple(
        (r["en"].strip(), r["de"].strip())
        for r in records
        if 6 <= len(r["en"].split()) <= 30 and r["en"].isascii()
    )


@cache
def _word_index() -> dict[str, tuple[int, ...]]:
    """Lowercase words of 5+ letters -> indexes of the WMT16 sentences holding them (3+)."""
    where: dict[str, set[int]] = defaultdict(set)
    for i, (en, _) in enumerate(_wmt_pairs()):
        for w in re.findall(r"\b[a-z]{5,}\b", en):
            where[w].add(i)
    return {w: tuple(sorted(ix)) for w, ix in where.items() if len(ix) >= 3}


def _typo(word: str, rng: random.Random) -> str:
    i = rng.randrange(1, len(word) - 1)
    op = rng.randrange(3)
    if op == 0:
        return word[:i] + word[i + 1] + word[i] + word[i + 2 :]
    if op == 1:
        return word[:i] + word[i + 1 :]
    return word[:i] + word[i] + word[i:]


def _fix_typos(rng: random.Random) -> RepetitiveTask:
    text = rng.choice(_alpaca_passages())
    words = text.split(" ")
    candidates = [i for i, w in enumerate(words) if w.isalpha() and len(w) >= 4]
    damaged = list(words)
    for i in rng.sample(candidates, max(1, len(candidates) // 8)) if candidates else []:
        damaged[i] = _typo(words[i], rng)
    message = (
        "Rewrite the following text, fixing the typos. Output only the corrected text.\n\n"
        + " ".join(damaged)
    )
    return RepetitiveTask("fix_typos", message, text)


def _extract(rng: random.Random) -> RepetitiveTask:
    index = _word_index()
    word = rng.choice(sorted(index))
    pairs = _wmt_pairs()
    hits = rng.sample(index[word], 3)
    others: list[int] = []
    while len(others) < 5:
        j = rng.randrange(len(pairs))
        if word not in pairs[j][0].lower() and j not in others:
            others.append(j)
    order = hits + others
    rng.shuffle(order)
    passage = " ".join(pairs[j][0] for j in order)
    message = f'Extract all sentences that mention "{word}", one per line.\n\n{passage}'
    reference = "\n".join(pairs[j][0] for j in order if j in hits)
    return RepetitiveTask("extract", message, reference)


def _to_json(rng: random.Random) -> RepetitiveTask:
    chosen = rng.sample(_wmt_pairs(), 4)
    listing = "\n".join(f"- English: {en} | German: {de}" for en, de in chosen)
    message = (
        'Convert this list to JSON: an array of objects with keys "en" and "de".\n\n' + listing
    )
    reference = json.dumps(
        [{"en": en, "de": de} for en, de in chosen], ensure_ascii=False, indent=1
    )
    return RepetitiveTask("to_json", message, reference)


def _bullets(rng: random.Random) -> RepetitiveTask:
    while True:
        text = rng.choice(_alpaca_passages())
        sentences = [s for s in _SENTENCE_END.split(text) if s]
        if len(sentences) >= 2:
            break
    message = (
        "Rewrite the following text as a bulleted list, one sentence per bullet, keeping the "
        "wording.\n\n" + text
    )
    return RepetitiveTask("bullets", message, "\n".join(f"- {s}" for s in sentences))


_BUILDERS = {"fix_typos": _fix_typos, "extract": _extract, "to_json": _to_json, "bullets": _bullets}


def build_repetitive_tasks(n: int, seed: int) -> list[RepetitiveTask]:
    """``n`` tasks, kinds rotating through :data:`KINDS` (see the module docstring).

    Raises:
        ValueError: when ``n`` is negative.
        FileNotFoundError: when the Alpaca / WMT16 samples are missing (says where to get them).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    return [_BUILDERS[KINDS[i % len(KINDS)]](rng) for i in range(n)]


def build_repetitive_prompts(n: int, seed: int, tokenizer: Any = None) -> list[str]:
    """The tasks' user messages rendered as single-turn chat prompts (generation prompt added).

    Args:
        n: number of prompts (>= 0).
        seed: RNG seed; the same ``(n, seed)`` gives the same prompts.
        tokenizer: a Hugging Face tokenizer with a chat template; None loads the bundled
            SmolLM2-135M-Instruct's (about 0.2 s once cached).

    Returns:
        ``n`` prompt strings, to pass as text prompts (the chat template is already applied).
    """
    if tokenizer is None:
        tokenizer = _bundled_tokenizer()
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t.message}], tokenize=False, add_generation_prompt=True
        )
        for t in build_repetitive_tasks(n, seed)
    ]


def _bundled_tokenizer() -> Any:
    from pagedllm.model.loader.bundled import bundled_model_path
    from pagedllm.model.loader.tokenizer import load_tokenizer

    return load_tokenizer(bundled_model_path())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=4, help="prompts printed in full")
    args = ap.parse_args()
    tok = _bundled_tokenizer()
    tasks = build_repetitive_tasks(args.n, args.seed)
    prompts = build_repetitive_prompts(args.n, args.seed, tok)
    for i, (task, prompt) in enumerate(zip(tasks, prompts, strict=True)):
        p_len = len(tok(prompt, add_special_tokens=False)["input_ids"])
        r_len = len(tok(task.reference, add_special_tokens=False)["input_ids"])
        print(f"[{i}] {task.kind}: prompt {p_len} tokens, reference answer {r_len} tokens")
        if i < args.show:
            print(prompt)
            print("--- reference ---")
            print(task.reference)
            print()


if __name__ == "__main__":
    main()
