"""Proposers: guess the next tokens of a sequence cheaply; the target model verifies them.

A proposal is only a guess: verification (``spec_decode.verify``) keeps exactly the tokens the
target itself would have produced, so a bad proposer costs time, never correctness.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from pagedllm.spec_decode.config import SpeculativeConfig


class Proposer(Protocol):
    """Proposes up to ``k`` next tokens of a sequence."""

    def propose(
        self, token_ids: Sequence[int], num_prompt_tokens: int, k: int, request_id: str
    ) -> list[int]:
        """0..k proposed next tokens for ``token_ids`` (prompt followed by the output so far)."""
        ...

    def on_request_finished(
        self, token_ids: Sequence[int], num_prompt_tokens: int, request_id: str
    ) -> None:
        """The request ended with ``token_ids`` (a proposer may learn from its output)."""
        ...


class MatchingProposer(Proposer, Protocol):
    """A proposer whose proposals continue a match of the sequence's last tokens (n-gram
    lookup, suffix decoding): it also reports the match length, which predicts acceptance
    (``spec_decode.policy.MatchAcceptance``)."""

    def propose_matched(
        self, token_ids: Sequence[int], num_prompt_tokens: int, k: int, request_id: str
    ) -> tuple[list[int], int]:
        """``propose``'s tokens and the length of the suffix of ``token_ids`` they continue
        (tokens; 0 with an empty proposal)."""
        ...


class NgramProposer:
    """Prompt-lookup decoding: find the most recent earlier occurrence of the sequence's last
    ``n`` tokens (``n`` from ``max_n`` down to ``min_n``, longest first) and propose the tokens that
    followed it (Saxena 2023, "prompt lookup decoding"; vLLM's ``ngram`` method).

    Args:
        min_n / max_n: shortest / longest suffix matched (tokens, 1 <= min_n <= max_n).

    Raises:
        ValueError: naming ``prompt_lookup_min`` / ``prompt_lookup_max`` when out of order.
    """

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(
                f"prompt_lookup_min ({min_n}) must be >= 1 and <= prompt_lookup_max ({max_n})"
            )
        self.min_n = min_n
        self.max_n = max_n

    def propose(
        self, token_ids: Sequence[int], num_prompt_tokens: int, k: int, request_id: str
    ) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier match of the last ``n`` tokens.

        The longest match wins, the most recent among equally long ones (in repetitive text it
        is the likeliest continuation). Vectorised with numpy: the candidates are the earlier
        positions of the last token, each extended backwards up to ``max_n`` tokens; O(len *
        max_n) element compares in C per call, no Python loop over the sequence.
        """
        return self.propose_matched(token_ids, num_prompt_tokens, k, request_id)[0]

    def propose_matched(
        self, token_ids: Sequence[int], num_prompt_tokens: int, k: int, request_id: str
    ) -> tuple[list[int], int]:
        """:meth:`propose`'s tokens and the length ``n`` of the match they continue (0 with
        no proposal)."""
        total = len(token_ids)
        if k <= 0 or total < 2:
            return [], 0
        ids = np.asarray(token_ids, dtype=np.int64)
        # Candidate match ends: earlier positions holding the last token (a token must follow).
        ends = np.flatnonzero(ids[:-1] == ids[-1])
        if ends.size == 0:
            return [], 0
        length = np.ones(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for j in range(1, min(self.max_n, total - 1)):
            pos = ends - j
            alive &= pos >= 0
            alive[alive] &= ids[pos[alive]] == ids[total - 1 - j]
            if not alive.any():
                break
            length += alive
        best = int(length.max())
        if best < self.min_n:
            return [], 0
        end = int(ends[np.flatnonzero(length == best)[-1]])  # the most recent longest match
        return ids[end + 1 : end + 1 + k].tolist(), best

    def on_request_finished(
        self, token_ids: Sequence[int], num_prompt_tokens: int, request_id: str
    ) -> None:
        """Nothing to learn: n-gram lookup only reads the request itself."""


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer ``config.method`` names.

    Raises:
        ValueError: naming ``speculative_config.method`` when "suffix" is asked for but the
            suffix proposer (``pagedllm.spec_decode.suffix``) is not available, or for
            "draft_model" (the engine builds that one, with its worker).
    """
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "draft_model":
        raise ValueError(
            "speculative_config.method 'draft_model' needs the engine's draft worker: "
            "LLMEngine builds it (spec_decode.draft_model.DraftModelProposer)"
        )
    try:
        suffix = importlib.import_module("pagedllm.spec_decode.suffix")
    except ImportError as e:
        raise ValueError(
            "speculative_config.method 'suffix' needs pagedllm.spec_decode.suffix, which is "
            f"not available: {e}"
        ) from e
    proposer: Proposer = suffix.SuffixProposer(
        max_depth=config.suffix_max_depth, max_cached_requests=config.suffix_max_cached_requests
    )
    return proposer
