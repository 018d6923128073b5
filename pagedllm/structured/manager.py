"""Structured outputs in the engine: compile off the engine thread, cache, mask, advance.

Life of a constrained request:

1. ``submit`` queues its grammar compile on a small thread pool (the engine thread never
   compiles); compiled grammars are cached by ``(kind, spec, whitespace options)``, so a repeated
   schema is ready at once. The scheduler skips the request (``is_ready``) until its compile
   finished, so the running batch never waits for it.
2. Every step, ``fill_bitmask`` brings each constrained sequence's matcher up to date with its
   generated tokens and writes its allowed next tokens into one int32 bitmask for the batch; the
   sampler turns the bitmask into ``-inf`` logits in one vectorized op
   (``mask.apply_token_bitmask_``). Stop tokens are allowed only where the grammar may end.
3. Matchers live here, keyed by sequence id, and count the tokens they accepted: a token is
   accepted exactly once, whatever happened to the sequence's KV (preemption by recompute or
   swap, prefix-cache hits). A forked sample (``n > 1``) gets a new matcher that replays the
   parent's tokens.
4. With speculative decoding, ``valid_draft_length`` cuts a proposal at the first token the
   grammar rejects and ``fill_draft_bitmask`` masks each of the ``k + 1`` verification rows as
   if the drafts before it had been generated; both roll the matcher back afterwards, so it
   advances only by the tokens really emitted (on the next catch-up).
5. ``release`` drops a finished request's matchers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.sequence import Sequence, SequenceGroup
from pagedllm.structured.backend import GRAMMAR_BACKENDS, GrammarBackend, GrammarMatcher
from pagedllm.structured.mask import TokenBitmask, bitmask_width

logger = logging.getLogger(__name__)

#: Compiled grammars kept (least recently used dropped first).
GRAMMAR_CACHE_SIZE = 256


def grammar_key(spec: StructuredOutputsParams) -> tuple[str, str, bool, str | None]:
    """The cache key of a constraint: its kind, its spec as canonical text, and the whitespace
    options (a schema given as a dict or as JSON text is the same key)."""
    kind = spec.kind
    value: Any = getattr(spec, kind)
    if kind == "json" and isinstance(value, str):
        with contextlib.suppress(ValueError):  # bad JSON stays text; the compile reports it
            value = json.loads(value)
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return kind, text, spec.disable_any_whitespace, spec.whitespace_pattern


class _SeqMatcher:
    __slots__ = ("matcher", "num_accepted")

    def __init__(self, matcher: GrammarMatcher) -> None:
        self.matcher = matcher
        self.num_accepted = 0


class StructuredOutputManager:
    """Grammar compiles, their cache, and the per-sequence matchers of one engine.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: V, the logits width.
        stop_token_ids: EOS ids (allowed only where a grammar may end).
        backend: a name in ``GRAMMAR_BACKENDS``.
        max_workers: compile threads.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        backend: str = "xgrammar",
        max_workers: int = 1,
    ) -> None:
        if backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"grammar backend must be one of {sorted(GRAMMAR_BACKENDS)}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.backend_name = backend
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._max_workers = max_workers
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str, bool, str | None], Future[Any]] = OrderedDict()
        self._requests: dict[str, Future[Any]] = {}  # live request id -> its compile
        self._unchecked: set[str] = set()  # requests whose compile result was not looked at
        self._matchers: dict[int, _SeqMatcher] = {}
        self.num_compiles = 0
        self.num_cache_hits = 0

    # ---- compiling (any thread) --------------------------------------------------------------
    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix="grammar")
        return self._pool

    def _get_backend(self) -> GrammarBackend:
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs the model's tokenizer, which is not loaded")
        # Building the tokenizer tables takes ~2 s for a 49k vocabulary: once, on first use, in
        # a compile thread (the engine thread asks only once a compile finished).
        with self._backend_lock:
            if self._backend is None:
                factory = GRAMMAR_BACKENDS[self.backend_name]
                self._backend = factory(self.tokenizer, self.vocab_size, self.stop_token_ids)
            return self._backend

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        return self._get_backend().compile(spec)

    def compile_future(self, spec: StructuredOutputsParams) -> Future[Any]:
        """The (cached or newly queued) compile of ``spec``; never blocks. The future's
        exception is a ValueError naming ``structured_outputs.<field>`` for a bad spec."""
        key = grammar_key(spec)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return fut
            fut = self._executor().submit(self._compile, spec)
            self.num_compiles += 1
            self._cache[key] = fut
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
            return fut

    def validate(self, spec: StructuredOutputsParams | None, timeout: float | None = None) -> None:
        """Compile ``spec`` (or take it from the cache), waiting for the result.

        Raises:
            ValueError: naming ``structured_outputs.<field>`` when it does not compile.
        """
        if spec is not None:
            self.compile_future(spec).result(timeout)

    # ---- requests (engine thread) ------------------------------------------------------------
    def submit(self, group: SequenceGroup) -> None:
        """Start the compile of a new constrained request (no-op for unconstrained ones)."""
        spec = group.sampling_params.structured_outputs
        if spec is not None:
            self._requests[group.request_id] = self.compile_future(spec)
            self._unchecked.add(group.request_id)

    def is_ready(self, group: SequenceGroup) -> bool:
        """False while the request's grammar is still compiling (the scheduler skips it)."""
        fut = self._requests.get(group.request_id)
        return fut is None or fut.done()

    @property
    def has_pending(self) -> bool:
        """Whether some live request's compile has not finished."""
        return any(not self._requests[r].done() for r in self._unchecked)

    def wait_pending(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for a pending compile to finish (an idle engine
        waits here instead of spinning)."""
        futs = [self._requests[r] for r in self._unchecked if not self._requests[r].done()]
        if futs:
            wait_futures(futs, timeout=timeout, return_when="FIRST_COMPLETED")

    def take_failed(self) -> list[tuple[str, BaseException]]:
        """Requests whose compile failed since the last call, with the error (the engine
        finishes them)."""
        failed: list[tuple[str, BaseException]] = []
        for rid in list(self._unchecked):
            fut = self._requests[rid]
            if fut.done():
                self._unchecked.discard(rid)
                exc = fut.exception()
                if exc is not None:
                    failed.append((rid, exc))
        return failed

    def release(self, group: SequenceGroup) -> None:
        """Forget a finished or aborted request's compile and matchers."""
        self._requests.pop(group.request_id, None)
        self._unchecked.discard(group.request_id)
        for seq in group.seqs:
            self._matchers.pop(seq.seq_id, None)

    # ---- the step (engine thread) ------------------------------------------------------------
    def fill_bitmask(self, pairs: list[tuple[Sequence, SequenceGroup]]) -> TokenBitmask | None:
        """The allowed next tokens of the constrained rows of a batch (row ``i`` is
        ``pairs[i]``), after catching each row's matcher up with its sequence's generated
        tokens; None when no row is constrained."""
        rows = [i for i, (_, g) in enumerate(pairs) if g.request_id in self._requests]
        if not rows:
            return None
        # One row per batch row (the fused kernel indexes both by row); only ``rows`` are read.
        bitmask = torch.empty(len(pairs), bitmask_width(self.vocab_size), dtype=torch.int32)
        for i in rows:
            matcher = self._matcher_for(*pairs[i])
            if matcher.is_terminated():
                # Past the grammar's end (EOS accepted, but ``ignore_eos`` goes on): unconstrained.
                bitmask[i] = -1
            else:
                matcher.fill_bitmask(bitmask, i)
        return TokenBitmask(bitmask, rows)

    def _matcher_for(self, seq: Sequence, group: SequenceGroup) -> GrammarMatcher:
        state = self._matchers.get(seq.seq_id)
        if state is None:
            # Done by now (the scheduler waited for it); a fork replays its parent's tokens.
            compiled = self._requests[group.request_id].result()
            state = self._matchers[seq.seq_id] = _SeqMatcher(
                self._get_backend().new_matcher(compiled)
            )
        start = seq.num_prompt_tokens + state.num_accepted
        for tid in seq.token_ids[start:]:
            if state.matcher.is_terminated():  # ``ignore_eos`` went past the grammar's end
                state.num_accepted = seq.num_output_tokens
                break
            if not state.matcher.accept_token(tid):
                # Cannot happen for sampled tokens (they were masked); never kill the step.
                logger.error("seq %d: token %d rejected by its grammar", seq.seq_id, tid)
            state.num_accepted += 1
        return state.matcher

    # ---- speculative decoding (engine thread) ------------------------------------------------
    def valid_draft_length(self, seq: Sequence, group: SequenceGroup, draft: list[int]) -> int:
        """How many leading tokens of ``draft`` (proposed continuation of ``seq``) its grammar
        allows: the proposer's draft is cut there. Unconstrained requests allow all. The
        matcher is walked through the draft and rolled back (nothing is committed)."""
        if group.request_id not in self._requests:
            return len(draft)
        past_end = group.sampling_params.ignore_eos  # else the sequence ends at the grammar's end
        return self._walk_draft(self._matcher_for(seq, group), draft, None, past_end)

    def fill_draft_bitmask(
        self, items: list[tuple[Sequence, SequenceGroup, list[int]]]
    ) -> TokenBitmask | None:
        """The allowed tokens of the verification rows of speculative sequences.

        Args:
            items: ``(sequence, group, draft)``; item ``i`` owns ``1 + len(draft)`` consecutive
                rows, row ``j`` of them the allowed next tokens *as if* ``draft[:j]`` had been
                generated (the mask the speculation-off engine would apply there). Drafts must
                be grammar-valid prefixes (``valid_draft_length``); rows past a draft token the
                grammar rejects can never be emitted and stay unconstrained.

        Returns:
            A [sum(1 + len(draft)), ceil(V / 32)] int32 ``TokenBitmask`` with the constrained
            rows, or None when no item is constrained. Every matcher is rolled back to the
            sequence's real tokens: it advances only by the accepted ones, on the next catch-up.
        """
        if not any(g.request_id in self._requests for _, g, _ in items):
            return None
        total = sum(1 + len(d) for _, _, d in items)
        bitmask = torch.empty(total, bitmask_width(self.vocab_size), dtype=torch.int32)
        rows: list[int] = []
        first = 0
        for seq, group, draft in items:
            if group.request_id in self._requests:

                def fill(j: int, matcher: GrammarMatcher, at: int = first) -> None:
                    rows.append(at + j)
                    if matcher.is_terminated():
                        bitmask[at + j] = -1  # past the grammar's end (``ignore_eos``): free
                    else:
                        matcher.fill_bitmask(bitmask, at + j)

                self._walk_draft(self._matcher_for(seq, group), draft, fill, True)
            first += 1 + len(draft)
        return TokenBitmask(bitmask, rows)

    @staticmethod
    def _walk_draft(
        matcher: GrammarMatcher,
        draft: list[int],
        fill: Callable[[int, GrammarMatcher], None] | None,
        past_end: bool,
    ) -> int:
        """Advance ``matcher`` through ``draft`` (calling ``fill(j, matcher)`` in the state
        after ``draft[:j]``, for every reachable ``j`` up to ``len(draft)``), stop at the first
        token it rejects (or at the grammar's end unless ``past_end``: there everything is
        allowed), then roll it back. Returns the number of allowed leading tokens."""
        advanced = 0
        for j, tid in enumerate(draft):
            if fill is not None:
                fill(j, matcher)
            if matcher.is_terminated() and not past_end:
                break
            if not matcher.is_terminated():
                if not matcher.accept_token(tid):
                    break
                advanced += 1
        else:
            j = len(draft)
            if fill is not None:
                fill(j, matcher)
        if advanced:
            matcher.rollback(advanced)
        return j

    @property
    def num_matchers(self) -> int:
        """Live per-sequence matchers (0 once every constrained request finished)."""
        return len(self._matchers)

    def shutdown(self) -> None:
        """Stop the compile threads (pending compiles are cancelled)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
