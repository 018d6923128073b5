"""Incremental (streaming) detokenization and stop-string search."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

#: Number of prompt tokens decoded in front of the output so the first output token's leading
#: space (SentencePiece "▁", byte-level "Ġ") is rendered as it is in context.
INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"
#: Most output tokens held back waiting for a character to complete (a UTF-8 character is at most
#: 4 bytes, so a byte sequence still invalid after 4 byte tokens is never completed).
MAX_HELD_TOKENS = 4


def direct_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str] | None:
    """The Rust ``tokenizers.Tokenizer.decode`` of a Hugging Face fast tokenizer, bound to
    ``skip_special_tokens``, when calling it gives exactly what ``tokenizer.decode`` gives:
    the tokenizer uses transformers' own ``TokenizersBackend._decode`` (no subclass override)
    and does not clean up tokenization spaces. None otherwise (the caller then goes through
    ``tokenizer.decode``).

    Why: the detokenizer decodes two short windows per output token; transformers' wrapper
    (argument conversion, keyword plumbing) cost ~5x the Rust decode itself, ~1 ms per
    batch-64 step (cProfile, AMX Xeon, 2026-12-06)."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # an older transformers: keep its decode
        return None
    rust = getattr(tokenizer, "_tokenizer", None)
    if (
        rust is None
        or type(tokenizer)._decode is not TokenizersBackend._decode
        or getattr(tokenizer, "clean_up_tokenization_spaces", True)
    ):
        return None
    return functools.partial(rust.decode, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns output token ids into text one token at a time, never splitting a UTF-8 character.

    Technique (prefix offset / read offset): the ids kept are the last few prompt ids followed by
    the output ids. ``tokens[prefix_offset:read_offset]`` is a small window already emitted;
    each step decodes it and ``tokens[prefix_offset:]`` and emits the extra characters. While the
    decoded tail ends with U+FFFD (a multi-byte character split over byte tokens) nothing is
    emitted and the offsets stay put; the text is released once the character is complete. The
    offsets only move to a point where the decoded text ends with a whole character, so the
    window always starts on a character boundary and decoding it is context-free for byte-level
    BPE (GPT-2 / SmolLM2) tokenizers.

    Liveness: bytes that never form valid UTF-8 (e.g. a lone continuation byte) are not held
    forever. Once ``MAX_HELD_TOKENS`` tokens are held, the oldest ones are released as the
    tokenizer decodes them (U+FFFD), at the latest cut ``k <= len - 3`` tokens where decoding
    both sides apart gives the same text as decoding them together (no character spans the cut);
    a character still incomplete at the end starts in the last 3 tokens, so it is never split.

    For a byte-level BPE tokenizer, the concatenation of every :meth:`append` result and
    :meth:`flush` equals ``tokenizer.decode(output_ids, skip_special_tokens=...)`` (provided the
    prompt does not end in the middle of a character).

    Args:
        tokenizer: a Hugging Face tokenizer (anything with ``decode(ids, skip_special_tokens=...,
            spaces_between_special_tokens=...)``).
        prompt_token_ids: the prompt's ids; only the last few are used as context.
        skip_special_tokens: drop special tokens from the text.
        spaces_between_special_tokens: forwarded to ``decode`` (slow tokenizers only).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        context = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self._tokens: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._num_context = len(context)
        self._chunks: list[str] = []
        self._text_cache: str | None = ""
        self._direct = direct_decoder(tokenizer, skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._direct is not None:
            return self._direct(ids)
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def _delta(self, final: bool) -> str:
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._tokens[self._prefix_offset :])
        if len(new_text) <= len(prefix_text):
            return ""
        end = len(self._tokens)
        if not final and new_text.endswith(_REPLACEMENT_CHAR):
            # Incomplete multi-byte character: hold back, up to MAX_HELD_TOKENS tokens.
            cut = self._release_cut(new_text)
            if cut is None:
                return ""
            end = cut
            new_text = self._decode(self._tokens[self._prefix_offset : cut])
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = end
        self._chunks.append(delta)
        self._text_cache = None
        return delta

    def _release_cut(self, new_text: str) -> int | None:
        """Where to release held tokens that still end in U+FFFD (see the class docstring), or
        None while fewer than ``MAX_HELD_TOKENS`` are held or no cut keeps the text unchanged."""
        n = len(self._tokens)
        if n - self._read_offset < MAX_HELD_TOKENS:
            return None
        for cut in range(n - 3, self._read_offset, -1):
            head = self._decode(self._tokens[self._prefix_offset : cut])
            if head + self._decode(self._tokens[cut:]) == new_text:
                return cut
        return None

    def clone(self) -> IncrementalDetokenizer:
        """An independent copy at the same position (a forked sample continues from here)."""
        other = copy.copy(self)
        other._tokens = list(self._tokens)
        other._chunks = list(self._chunks)
        return other

    def append(self, token_id: int) -> str:
        """Add one generated token id.

        Returns:
            The newly stable text (may be ``""``): never ends with a partial UTF-8 character;
            bytes still invalid after ``MAX_HELD_TOKENS`` tokens come out as U+FFFD.
        """
        self._tokens.append(int(token_id))
        return self._delta(final=False)

    def flush(self) -> str:
        """At finish: release whatever is held back (may contain U+FFFD if truly invalid)."""
        return self._delta(final=True)

    @property
    def output_text(self) -> str:
        """All stable text of the output so far (the concatenation of the returned deltas)."""
        if self._text_cache is None:
            self._text_cache = "".join(self._chunks)
            self._chunks = [self._text_cache]
        return self._text_cache

    @property
    def output_token_ids(self) -> list[int]:
        """The output ids appended so far (without the prompt context)."""
        return self._tokens[self._num_context :]


def find_stop_string(
    text: str, new_text_len: int, stops: list[str], include_stop: bool
) -> int | None:
    """Look for a stop string that newly appeared at the end of ``text``.

    Only occurrences that end inside the last ``new_text_len`` characters are considered (the
    search region is the last ``new_text_len + len(stop) - 1`` characters for each stop); older
    ones would have been found on an earlier call. When several stops match, the one that is
    completed first (smallest end position; ties: the longest) wins, as it would when streaming
    one character at a time.

    Args:
        text: the full output text so far (characters).
        new_text_len: number of characters appended to ``text`` since the last call (>= 0).
        stops: stop strings (non-empty).
        include_stop: keep the stop string in the output.

    Returns:
        The length (characters) to truncate ``text`` to: the end of the match when
        ``include_stop`` else its start; None when no stop string appeared.
    """
    if new_text_len <= 0 or not stops:
        return None
    best: tuple[int, int] | None = None  # (end, -len)
    best_start = 0
    n = len(text)
    for stop in stops:
        if not stop:
            continue
        start = max(0, n - new_text_len - len(stop) + 1)
        idx = text.find(stop, start)
        if idx < 0:
            continue
        key = (idx + len(stop), -len(stop))
        if best is None or key < best:
            best = key
            best_start = idx
    if best is None:
        return None
    return best[0] if include_stop else best_start
