"""Tokenizer loading (Hugging Face folder or GGUF metadata) and the set of end-of-generation ids."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # transformers is imported where it is used: a TP/PP worker process never
    # loads a tokenizer, and importing transformers costs it ~2 s of start-up.
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

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
            tokens, chat template) is then built from its metadata (about 6 s for a 49k-token
            vocabulary) and saved to :func:`tokenizer_cache_dir`, so later loads of the same
            file take ~0.2 s.

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
        return _load_gguf_tokenizer_cached(p / gguf_file)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(p))


def tokenizer_cache_dir(gguf_path: str | os.PathLike[str]) -> Path:
    """Where the tokenizer built from ``gguf_path`` is saved (``save_pretrained``) for reuse.

    Under ``$PAGEDLLM_CACHE_DIR`` (default ``$XDG_CACHE_HOME/pagedllm`` or
    ``~/.cache/pagedllm``), in ``tokenizers/<key>``, where the key hashes the file's resolved path,
    size and modification time (nanoseconds) and the transformers version, so a replaced file or
    a new transformers gets a fresh entry.
    """
    import transformers

    key = file_cache_key(gguf_path, f"transformers {transformers.__version__}", "v1")
    return pagedllm_cache_dir() / "tokenizers" / key[:16]


def file_cache_key(path: str | os.PathLike[str], *extra: str) -> str:
    """A hex SHA-1 naming a cache entry derived from the file at ``path``: it hashes the
    resolved path, size and modification time (ns) and the ``extra`` parts (versions), so a
    replaced file or a new library version gets a fresh entry.

    Raises:
        OSError: the file cannot be stat'ed.
    """
    f = Path(path).resolve()
    st = f.stat()
    ident = "|".join([str(f), str(st.st_size), str(st.st_mtime_ns), *extra])
    return hashlib.sha1(ident.encode()).hexdigest()


def pagedllm_cache_dir() -> Path:
    """pagedllm's cache folder: ``$PAGEDLLM_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagedllm``, else
    ``~/.cache/pagedllm`` (not created here)."""
    root = os.environ.get("PAGEDLLM_CACHE_DIR") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedllm"
    )
    return Path(root)


def _load_gguf_tokenizer_cached(gguf_path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of ``gguf_path``, from the cache when present, else built and then cached.

    Building it means transformers parsing the whole GGUF metadata (~6 s for SmolLM2's 49k
    tokens and merges); the saved fast tokenizer loads in ~0.2 s. The entry is written to a
    temporary folder and renamed into place, so a concurrent or interrupted writer never leaves a
    half-written entry; any failure to read or write the cache falls back to the GGUF itself.
    """
    from transformers import AutoTokenizer

    cache = tokenizer_cache_dir(gguf_path)
    if (cache / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cache))
        except Exception as exc:  # noqa: BLE001 - a damaged entry: rebuild it from the GGUF
            logger.warning("ignoring the cached tokenizer in %s (%s)", cache, exc)
            shutil.rmtree(cache, ignore_errors=True)
    tokenizer = _tokenizer_from_gguf(gguf_path)
    try:
        if cache.exists():  # a leftover without tokenizer.json would block the rename below
            shutil.rmtree(cache)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=cache.name + ".", dir=cache.parent))
        try:
            tokenizer.save_pretrained(str(tmp))
            os.replace(tmp, cache)  # atomic; fails if another process got there first
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception as exc:  # noqa: BLE001 - read-only home, full disk, a concurrent writer:
        # caching is an optimisation, so a failure only means the next load builds it again.
        logger.debug("tokenizer not cached in %s: %s", cache, exc)
    return tokenizer


def _tokenizer_from_gguf(gguf_path: Path) -> PreTrainedTokenizerBase:
    """transformers' tokenizer for a GGUF file. ``AutoTokenizer`` reads the file's model config
    first and refuses an architecture transformers has no GGUF support for (in 5.25: OLMo 2,
    Granite, Gemma v1, Phi-2, GPT-NeoX, ...), although the tokenizer itself only depends on the
    ``tokenizer.ggml.*`` keys; for those files the tokenizer is built from the keys alone
    (transformers' own GGUF tokenizer conversion, wrapped as a fast tokenizer).

    Raises:
        ValueError: transformers' error, when it cannot build the tokenizer either way.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except ValueError as exc:
        if "is not supported" not in str(exc):
            raise
        try:  # transformers >= 5: the conversion that AutoTokenizer itself calls
            from transformers import PreTrainedTokenizerFast
            from transformers.integrations.gguf.gguf_tokenizer_mapping import (
                convert_gguf_tokenizer,
                get_gguf_tokenizer,
            )
        except ImportError:
            raise exc from None
        architecture, tokens, config = get_gguf_tokenizer(str(gguf_path))
        backend, extra = convert_gguf_tokenizer(architecture, tokens)
        logger.info(
            "GGUF architecture %r: tokenizer built from the file's tokenizer keys", architecture
        )
        return PreTrainedTokenizerFast(tokenizer_object=backend, **{**config, **extra})


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
