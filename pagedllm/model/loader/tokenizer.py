"""Tokenizer loading (Hugging Face folder or GGUF metadata) and the set of end-of-generation ids."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

# Substrings of special-token names that mark the end of a chat turn, e.g. <|im_end|> (ChatML),
# <|eot_id|> / <|eom_id|> (Llama 3), <end_of_turn> (Gemma), <|end|> (Phi-3).
_END_OF_TURN_MARKERS = ("im_end", "eot", "eom_id", "end_of_turn", "end_turn")
_END_OF_TURN_EXACT = ("<|end|>",)


def load_tokenizer(
    path: str | os.PathLike[str], gguf_file: str | None = None
) -> PreTrainedTokenizerBase:
    """Load a tokenizer with ``transformers.AutoTokenizer``.

    Args:
        path: a Hugging Face folder, or the folder holding ``gguf_file``, or a ``.gguf`` file
            itself (then ``gguf_file`` is taken from its name).
        gguf_file: name of a GGUF file inside ``path``; the tokenizer (vocabulary, merges, special
            tokens, chat template) is then built from its metadata (about 7 s for a 49k-token
            vocabulary).

    Returns:
        A fast tokenizer, with ``chat_template`` when the source has one.

    Raises:
        FileNotFoundError: ``path`` (or ``path/gguf_file``) does not exist.
        ValueError / OSError: transformers cannot build a tokenizer from it.
    """
    p = Path(path)
    if p.is_file() and gguf_file is None:
        p, gguf_file = p.parent, p.name
    if not p.exists():
        raise FileNotFoundError(f"tokenizer path not found: {p}")
    if gguf_file is not None:
        if not (p / gguf_file).is_file():
            raise FileNotFoundError(f"GGUF file not found: {p / gguf_file}")
        return AutoTokenizer.from_pretrained(str(p), gguf_file=gguf_file)
    return AutoTokenizer.from_pretrained(str(p))


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if v is not None]
    return [int(value)]


def read_generation_config_eos(folder: str | os.PathLike[str]) -> list[int]:
    """``eos_token_id`` of ``folder/generation_config.json`` as a list (empty if absent)."""
    f = Path(folder) / "generation_config.json"
    if not f.is_file():
        return []
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return []
    return _as_ids(data.get("eos_token_id"))


def chat_template_end_of_turn_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids of end-of-turn special tokens that appear literally in the tokenizer's chat template.

    A token qualifies when it is a special (added) token, its text occurs in the template, its
    name marks an end of turn (``<|im_end|>``, ``<|eot_id|>``, ``<|eom_id|>``, ``<end_of_turn>``,
    ``<|end|>``...) and it encodes to a single id.
    """
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates
        template = "\n".join(str(t) for t in template.values())
    if not template:
        return []
    ids: list[int] = []
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    for token_id, added in sorted(decoder.items()):
        content = getattr(added, "content", str(added))
        if not getattr(added, "special", True) or content not in template:
            continue
        low = content.lower()
        if not (any(m in low for m in _END_OF_TURN_MARKERS) or low in _END_OF_TURN_EXACT):
            continue
        if tokenizer.convert_tokens_to_ids(content) == token_id:
            ids.append(int(token_id))
    return ids


def eos_token_ids(
    tokenizer: PreTrainedTokenizerBase,
    *,
    gguf_eos_token_id: int | None = None,
    hf_folder: str | os.PathLike[str] | None = None,
    extra: Iterable[int | None] = (),
) -> list[int]:
    """Every token id that ends generation, deduplicated, in this order of discovery.

    1. ``tokenizer.eos_token_id``;
    2. ``gguf_eos_token_id`` (the GGUF ``tokenizer.ggml.eos_token_id``), when given;
    3. ``config.json`` and ``generation_config.json`` ``eos_token_id`` (int or list) of
       ``hf_folder``, when given;
    4. ``extra`` ids;
    5. the chat template's end-of-turn special token(s), see :func:`chat_template_end_of_turn_ids`.

    Returns:
        A list of ints (possibly empty if nothing defines an EOS).
    """
    found: list[int] = []
    found += _as_ids(getattr(tokenizer, "eos_token_id", None))
    found += _as_ids(gguf_eos_token_id)
    if hf_folder is not None:
        cfg = Path(hf_folder) / "config.json"
        if cfg.is_file():
            with contextlib.suppress(OSError, json.JSONDecodeError):
                found += _as_ids(json.loads(cfg.read_text(encoding="utf-8")).get("eos_token_id"))
        found += read_generation_config_eos(hf_folder)
    found += _as_ids(list(extra))
    found += chat_template_end_of_turn_ids(tokenizer)
    out: list[int] = []
    for i in found:
        if i not in out:
            out.append(i)
    return out
