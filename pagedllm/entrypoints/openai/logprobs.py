"""Token texts and bytes, and the two logprobs shapes of the API (completions' legacy parallel
lists, chat's per-token objects).

Logprobs are natural logs; -inf (or NaN) is not JSON and is reported as ``MIN_LOGPROB``, as vLLM
does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedllm.outputs import PositionLogprobs

#: Logprobs of -inf (or NaN) are not JSON; they are reported as this value, as vLLM does.
MIN_LOGPROB = -9999.0


def clamp_logprob(x: float) -> float:
    """``x``, or ``MIN_LOGPROB`` when it is lower (or NaN: every comparison with NaN is false)."""
    return x if x >= MIN_LOGPROB else MIN_LOGPROB


def empty_legacy_logprobs() -> dict[str, list]:
    """The completions logprobs object with no token yet."""
    return {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}


def _byte_level_alphabet() -> dict[str, int]:
    """The reversible byte <-> printable character map of byte-level BPE tokenizers: bytes that
    are printable stay themselves, the other 68 are shifted to code points 256 and up."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: b for b in keep}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + shift
            shift += 1
    return {chr(c): b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_level_alphabet()


class TokenFormatter:
    """Token texts / bytes (cached per token id) and the logprobs shapes, for one tokenizer.

    Args:
        tokenizer: a HF tokenizer only the event loop uses (``AsyncLLMEngine.tokenizer``).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._token_bytes: dict[int, list[int]] = {}
        self._token_str: dict[int, str] = {}

    def token_str(self, tid: int, entry: PositionLogprobs | None = None) -> str:
        """The text of token ``tid``: the engine's decoding in ``entry`` when it has one, else
        the tokenizer's decoding of the token alone."""
        if entry is not None and tid in entry:
            decoded = entry[tid].decoded_token
            if decoded is not None:
                return decoded
        text = self._token_str.get(tid)
        if text is None:
            text = self._token_str[tid] = str(self.tokenizer.decode([tid]))
        return text

    def token_bytes(self, tid: int, text: str) -> list[int]:
        """Raw bytes of a token (byte-level BPE), else the UTF-8 of its text."""
        b = self._token_bytes.get(tid)
        if b is None:
            piece = self.tokenizer.convert_ids_to_tokens(tid)
            b = list(text.encode("utf-8"))
            # A token holding part of a multi-byte character decodes to U+FFFD: give its raw bytes.
            if (
                "\ufffd" in text
                and isinstance(piece, str)
                and piece
                and all(c in _BYTE_OF_CHAR for c in piece)
            ):
                b = [_BYTE_OF_CHAR[c] for c in piece]
            self._token_bytes[tid] = b
        return b

    def legacy_logprobs(
        self,
        token_ids: Sequence[int],
        entries: Sequence[PositionLogprobs | None],
        k: int,
        offset: int,
        acc: dict[str, list] | None = None,
    ) -> tuple[dict[str, list], int]:
        """Completions logprobs (``tokens``, ``token_logprobs``, ``top_logprobs``,
        ``text_offset``) of ``token_ids`` with the ``k`` best alternatives, appended to ``acc``
        (a new object when None); returns it and the text offset (characters) after the last
        token. A token without an entry gets None logprobs."""
        acc = acc or empty_legacy_logprobs()
        for tid, entry in zip(token_ids, entries, strict=False):
            tok = self.token_str(tid, entry)
            acc["tokens"].append(tok)
            acc["text_offset"].append(offset)
            offset += len(tok)
            if entry is None or tid not in entry:
                acc["token_logprobs"].append(None)
                acc["top_logprobs"].append(None)
                continue
            acc["token_logprobs"].append(clamp_logprob(entry[tid].logprob))
            top: dict[str, float] = {}
            for alt, lp in sorted(entry.items(), key=lambda kv: kv[1].rank or 0):
                if alt == tid or (lp.rank is not None and lp.rank <= k):
                    top.setdefault(self.token_str(alt, entry), clamp_logprob(lp.logprob))
            acc["top_logprobs"].append(top)
        return acc, offset

    def chat_logprobs(
        self, token_ids: Sequence[int], entries: Sequence[PositionLogprobs], k: int
    ) -> list[dict[str, Any]]:
        """Chat logprobs of ``token_ids`` with the ``k`` best alternatives:
        ``[{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]``."""
        content = []
        for tid, entry in zip(token_ids, entries, strict=False):
            tok = self.token_str(tid, entry)
            tops = sorted(
                (lp.rank, alt, lp)
                for alt, lp in entry.items()
                if lp.rank is not None and lp.rank <= k
            )
            top_list = []
            for _, alt, lp in tops[:k]:
                t = self.token_str(alt, entry)
                top_list.append(
                    {
                        "token": t,
                        "logprob": clamp_logprob(lp.logprob),
                        "bytes": self.token_bytes(alt, t),
                    }
                )
            content.append(
                {
                    "token": tok,
                    "logprob": clamp_logprob(entry[tid].logprob) if tid in entry else MIN_LOGPROB,
                    "bytes": self.token_bytes(tid, tok),
                    "top_logprobs": top_list,
                }
            )
        return content
