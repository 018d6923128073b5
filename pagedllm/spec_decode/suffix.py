"""Suffix-decoding proposer (Oliaro et al. 2024, "SuffixDecoding: A Model-Free Approach to
Speeding Up Large Language Model Inference", sections 3-4).

SuffixDecoding keeps suffix structures over the current request's prompt and output and over the
outputs of recently finished requests, finds the longest suffix of the sequence so far that
occurs in them, and proposes the continuation with the highest empirical frequency, growing it
token by token while its estimated probability (the product of the per-token frequency shares)
stays above ``min_token_prob``: the speculation depth follows the counts.

This module gets the same statistics without materialising a suffix tree (a depth-``D`` suffix
trie costs ``D`` nodes per token, too much for Python objects): every document keeps its tokens
and two position indexes, last token -> positions and last two tokens -> positions. A proposal

1. collects the occurrences of the sequence's last two tokens (or, when they never occur, its last
   token) in the request's own document and in the cached outputs, newest first, at most
   ``_MAX_CANDIDATES_PER_DOC`` per document and ``_MAX_CANDIDATES`` in all;
2. extends each occurrence backwards to its match length (at most ``max_match_len``) and keeps
   those with the longest match, i.e. the occurrences of the longest matching suffix: the node
   a suffix-tree walk would reach;
3. walks forward: at depth ``d`` the next token of every surviving occurrence is counted, the most
   frequent one (ties: the newest occurrence) is proposed, the running probability is multiplied
   by its share, occurrences that disagree are dropped; it stops at ``k`` / ``max_depth`` tokens,
   when no occurrence continues, or when the running probability falls below ``min_token_prob``
   (optionally also at ``max_spec_factor`` times the match length).

Cost: appending a token is O(1) (two list appends); a proposal is O(C * (max_match_len + k))
with C <= ``_MAX_CANDIDATES`` occurrences, plus one dict lookup per cached request. Memory: the
tokens and two positions per token of every running request (freed by
:meth:`SuffixProposer.on_request_finished`) and of the outputs of at most
``max_cached_requests`` finished requests (oldest evicted first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

#: occurrences taken from one document per proposal (the newest ones).
_MAX_CANDIDATES_PER_DOC = 32
#: occurrences considered per proposal over all documents.
_MAX_CANDIDATES = 128


def _pair_key(first: int, second: int) -> int:
    """One int key for a pair of token ids (ids are < 2**32)."""
    return (first << 32) | second


class _Document:
    """Tokens of one sequence with last-token and last-two-tokens position indexes."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.by_token: dict[int, list[int]] = {}
        self.by_pair: dict[int, list[int]] = {}

    def extend(self, new_tokens: Sequence[int]) -> None:
        """Append tokens, indexing each new position: O(1) per token."""
        toks = self.tokens
        for t in new_tokens:
            pos = len(toks)
            self.by_token.setdefault(t, []).append(pos)
            if pos:
                self.by_pair.setdefault(_pair_key(toks[-1], t), []).append(pos)
            toks.append(t)


class SuffixProposer:
    """Proposes draft tokens by suffix matching over this request and recent requests' outputs.

    See the module docstring for the algorithm and its cost. One instance serves all requests of
    an engine; it is not thread safe.

    Args:
        max_depth: most tokens proposed per call (the continuation depth), >= 1.
        max_cached_requests: finished requests whose outputs are kept for cross-request
            matches, >= 0; the oldest is evicted first.
        min_token_prob: stop growing the proposal when the product of the frequency shares of
            its tokens falls below this, in [0, 1].
        max_match_len: longest suffix of the sequence matched (longer matches are more
            specific; the length is capped to bound the cost), >= 1.
        max_spec_factor: when > 0, a proposal is also capped to
            ``max(1, int(max_spec_factor * match length))`` tokens (SuffixDecoding's adaptive
            speculation length, section 4: short matches are less reliable); 0 turns the cap
            off. On the repetitive workload's oracle replay (benchmarks/spec_building_blocks.py,
            k = 8) 1.0 raises the acceptance rate from 0.60 to 0.74 but lowers tokens per
            step from 4.85 to 3.73, hence off by default: rejected drafts are nearly free at
            the small batches where speculation runs.

    Raises:
        ValueError: naming the argument out of range.
    """

    def __init__(
        self,
        max_depth: int = 16,
        max_cached_requests: int = 256,
        min_token_prob: float = 0.1,
        *,
        max_match_len: int = 8,
        max_spec_factor: float = 0.0,
    ) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        if max_cached_requests < 0:
            raise ValueError(f"max_cached_requests must be >= 0, got {max_cached_requests}")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob}")
        if max_match_len < 1:
            raise ValueError(f"max_match_len must be >= 1, got {max_match_len}")
        if max_spec_factor < 0:
            raise ValueError(f"max_spec_factor must be >= 0, got {max_spec_factor}")
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.min_token_prob = min_token_prob
        self.max_match_len = max_match_len
        self.max_spec_factor = max_spec_factor
        self._active: dict[str, _Document] = {}
        self._finished: OrderedDict[str, _Document] = OrderedDict()

    # ------------------------------------------------------------------------------------------
    def propose(
        self, token_ids: Sequence[int], num_prompt_tokens: int, k: int, request_id: str
    ) -> list[int]:
        """Up to ``min(k, max_depth)`` draft tokens to follow ``token_ids``.

        Only the tokens appended since the previous call for ``request_id`` are indexed. When
        ``token_ids`` is not an extension of what was seen before (shorter, or a different last
        seen token), the request's document is rebuilt.

        Args:
            token_ids: the prompt followed by the tokens generated so far (accepted ones only).
            num_prompt_tokens: how many leading entries of ``token_ids`` are the prompt.
            k: most tokens wanted, >= 0.
            request_id: key of the sequence (use one key per sequence when a request has n > 1).

        Returns:
            The proposed token ids, possibly empty.

        Raises:
            ValueError: when ``k`` is negative or ``num_prompt_tokens`` is not in
                ``[0, len(token_ids)]``.
        """
        return self.propose_matched(token_ids, num_prompt_tokens, k, request_id)[0]

    def propose_matched(
        self, token_ids: Sequence[int], num_prompt_tokens: int, k: int, request_id: str
    ) -> tuple[list[int], int]:
        """:meth:`propose`'s tokens and the length of the longest matching suffix they
        continue (0 with no proposal); the same arguments and errors."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if not 0 <= num_prompt_tokens <= len(token_ids):
            raise ValueError(
                f"num_prompt_tokens must be in [0, {len(token_ids)}], got {num_prompt_tokens}"
            )
        doc = self._sync(request_id, token_ids)
        if k == 0 or not doc.tokens:
            return [], 0
        starts, match_len = self._longest_matches(doc)
        depth = min(k, self.max_depth)
        if self.max_spec_factor > 0:
            depth = min(depth, max(1, int(self.max_spec_factor * match_len)))
        proposal = self._continue(starts, depth)
        return proposal, match_len if proposal else 0

    def on_request_finished(
        self, token_ids: Sequence[int], num_prompt_tokens: int, request_id: str
    ) -> None:
        """Forget the request's own document and cache its output for later requests.

        Call it for every finished or aborted sequence (it frees the running document). The
        output ``token_ids[num_prompt_tokens:]`` joins the cache as the newest entry; past
        ``max_cached_requests`` entries the oldest is evicted.

        Raises:
            ValueError: when ``num_prompt_tokens`` is not in ``[0, len(token_ids)]``.
        """
        if not 0 <= num_prompt_tokens <= len(token_ids):
            raise ValueError(
                f"num_prompt_tokens must be in [0, {len(token_ids)}], got {num_prompt_tokens}"
            )
        self._active.pop(request_id, None)
        self._finished.pop(request_id, None)
        output = token_ids[num_prompt_tokens:]
        if self.max_cached_requests == 0 or len(output) < 2:
            return
        doc = _Document()
        doc.extend(output)
        self._finished[request_id] = doc
        while len(self._finished) > self.max_cached_requests:
            self._finished.popitem(last=False)

    @property
    def num_cached_requests(self) -> int:
        """How many finished requests' outputs are cached (<= ``max_cached_requests``)."""
        return len(self._finished)

    @property
    def num_active_requests(self) -> int:
        """How many running sequences have a document (freed by ``on_request_finished``)."""
        return len(self._active)

    # ------------------------------------------------------------------------------------------
    def _sync(self, request_id: str, token_ids: Sequence[int]) -> _Document:
        """The request's document, extended with the tokens it has not seen yet."""
        doc = self._active.get(request_id)
        seen = 0 if doc is None else len(doc.tokens)
        if doc is None or seen > len(token_ids) or (seen and token_ids[seen - 1] != doc.tokens[-1]):
            doc = self._active[request_id] = _Document()
            seen = 0
        doc.extend(token_ids[seen:])
        return doc

    def _longest_matches(self, doc: _Document) -> tuple[list[tuple[list[int], int]], int]:
        """``(tokens, start)`` of the continuations after the longest matching suffix of
        ``doc.tokens``, newest first (the request's own document, then the cached outputs),
        and that match length (0: no match)."""
        ctx = doc.tokens
        keys = [(False, ctx[-1])]
        if len(ctx) >= 2 and self.max_match_len >= 2:
            keys.insert(0, (True, _pair_key(ctx[-2], ctx[-1])))
        docs = [doc, *reversed(self._finished.values())]
        for pair, key in keys:
            found: list[tuple[list[int], int]] = []
            for d in docs:
                positions = (d.by_pair if pair else d.by_token).get(key)
                if not positions:
                    continue
                recent = positions[-_MAX_CANDIDATES_PER_DOC - 1 :]
                if recent[-1] == len(d.tokens) - 1:
                    recent.pop()  # the document's last token has no continuation (yet)
                toks = d.tokens
                found.extend((toks, pos) for pos in reversed(recent[-_MAX_CANDIDATES_PER_DOC:]))
                if len(found) >= _MAX_CANDIDATES:
                    break
            if found:
                return self._keep_longest(ctx, found[:_MAX_CANDIDATES], 2 if pair else 1)
        return [], 0

    def _keep_longest(
        self, ctx: list[int], found: list[tuple[list[int], int]], known: int
    ) -> tuple[list[tuple[list[int], int]], int]:
        """Extend each occurrence's match backwards (``known`` tokens already match) and keep
        those with the longest match, as continuation starts, with that length."""
        last = len(ctx) - 1
        limit = min(self.max_match_len, len(ctx))
        best = known
        starts: list[tuple[list[int], int]] = []
        for toks, pos in found:
            m = known
            stop = min(limit, pos + 1)
            while m < stop and toks[pos - m] == ctx[last - m]:
                m += 1
            if m > best:
                best, starts = m, []
            if m == best:
                starts.append((toks, pos + 1))
        return starts, best

    def _continue(self, starts: list[tuple[list[int], int]], depth: int) -> list[int]:
        """Greedy most-frequent walk from the continuation starts (module docstring, step 3)."""
        proposal: list[int] = []
        prob = 1.0
        for d in range(depth):
            counts: dict[int, int] = {}
            for toks, s in starts:
                if s + d < len(toks):
                    t = toks[s + d]
                    counts[t] = counts.get(t, 0) + 1
            if not counts:
                break
            token = max(counts, key=counts.__getitem__)  # first maximum: the newest occurrence
            prob *= counts[token] / sum(counts.values())
            if prob < self.min_token_prob:
                break
            proposal.append(token)
            starts = [(toks, s) for toks, s in starts if s + d < len(toks) and toks[s + d] == token]
        return proposal
