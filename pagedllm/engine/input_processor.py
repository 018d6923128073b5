"""Input processing: tokenize and validate a request, then build what the engine core queues.

``InputProcessor.process`` turns ``(request_id, prompt, SamplingParams)`` into a
``SequenceGroup`` of one ``Sequence`` (its seed drawn, its incremental detokenizer set up, its
``BeamSearch`` state attached for beam search); parallel samples and beams are forked from that
sequence later, by the engine core, once its prompt is computed (paper section 4.4).
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import random
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.kv_manager import ContextLengthExceededError, KVManager
from pagedllm.engine.beam_search import BeamSearch
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.parallel_sampling import num_samples
from pagedllm.outputs import RequestMetrics
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceGroup

__all__ = ["ContextLengthExceededError", "InputProcessor"]


def require_valid_unicode(text: str, field: str) -> None:
    """Check that ``text`` can be encoded as UTF-8, as the tokenizer needs.

    Raises:
        ValueError: naming ``field`` when ``text`` holds a lone UTF-16 surrogate
            (U+D800..U+DFFF; the tokenizer would raise a ``TypeError``).
    """
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{field} holds a lone UTF-16 surrogate {text[e.start]!a} at character {e.start}, "
            "which is not valid Unicode"
        ) from None


def prefix_cache_extra(cache_salt: str | None, prompt_key: str | None) -> bytes | None:
    """A sequence's prefix-cache key material beyond its tokens (``Sequence.cache_salt``): None
    without a salt or prompt key, else both fields length-prefixed, so that no salt can pose
    as another salt plus a key."""
    if cache_salt is None and prompt_key is None:
        return None
    fields = [(cache_salt or "").encode(), (prompt_key or "").encode()]
    return b"".join(struct.pack("<I", len(f)) + f for f in fields)


class InputProcessor:
    """Tokenizes, validates and builds requests.

    Args:
        config: engine options (``seed``, ``max_logprobs``).
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the model's vocabulary size (valid ids are ``0 .. vocab_size - 1``).
        max_model_len: longest sequence in tokens (prompt + output).
        eos_token_ids: the model's end-of-sequence ids (beam search's stopping tokens).
        kv: the KV manager (``check_request_fits``: what its pool can ever hold).
        seq_ids: the engine's sequence-id counter (shared with the core's forks).
        prompt_key: what a prompt's KV blocks depend on beyond its tokens, from its length
            (``rope_scaling.prompt_frequency_key``); None: nothing.
    """

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: list[int],
        kv: KVManager,
        seq_ids: Iterator[int],
        prompt_key: Callable[[int], str | None] | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.kv = kv
        self._seq_ids = seq_ids
        self._prompt_key = prompt_key
        self._seed_rng = random.Random(config.seed)
        self._arrivals = itertools.count()

    def tokenize(self, prompt: str) -> list[int]:
        """The prompt's token ids under the model's tokenizer (special tokens as it adds them).

        Raises:
            ValueError: naming ``prompt`` when it is not valid Unicode (a lone surrogate).
        """
        require_valid_unicode(prompt, "prompt")
        return list(self.tokenizer(prompt).input_ids)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request before it enters the engine; returns its effective max_tokens.

        Raises:
            ValueError: naming the field: ``prompt`` (empty, ids not integers in the vocabulary, too
                long), ``max_tokens`` (prompt + max_tokens over ``max_model_len``, or one
                sequence needing more blocks than the whole pool), ``n`` / ``best_of`` (whichever
                asks for more sequences: more than ``max_num_seqs``, prompts that together with
                a first token each do not fit in the pool, or several sequences on a KV manager
                that cannot share blocks), ``logprobs`` / ``prompt_logprobs`` (over ``max_logprobs``),
                ``stop_token_ids`` / ``logit_bias`` (ids outside the vocabulary), beam search
                with stop strings or non-default temperature / top_p / top_k,
                ``num_speculative_tokens`` on an engine without a ``speculative_config``.
                ``ContextLengthExceededError`` (a ``ValueError``) for the length and pool limits.
        """
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        # bool is an int subclass, but True is no token id (it would silently mean token 1).
        bad = [
            t
            for t in prompt_token_ids
            if isinstance(t, bool) or not (isinstance(t, int) and 0 <= t < self.vocab_size)
        ]
        if bad:
            raise ValueError(
                f"prompt contains token ids that are not integers in the vocabulary "
                f"[0, {self.vocab_size}): {bad[:5]}"
            )
        params.verify_token_ids(self.vocab_size)
        if params.pooling is not None:
            return self._validate_pooling(len(prompt_token_ids), params)
        if params.use_beam_search:
            if params.stop:
                raise ValueError("stop strings are not supported with use_beam_search")
            if params.temperature not in (0.0, 1.0) or params.top_p < 1.0 or params.top_k > 1:
                raise ValueError(
                    "temperature / top_p / top_k must keep their defaults with use_beam_search"
                )
        if params.num_speculative_tokens and self.config.speculative is None:
            raise ValueError(
                "num_speculative_tokens needs an engine started with a speculative_config"
            )
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.config.max_logprobs:
                raise ValueError(f"{name} must be <= {self.config.max_logprobs}, got {k}")
        n_prompt = len(prompt_token_ids)
        if n_prompt >= self.max_model_len:
            raise ContextLengthExceededError(
                f"prompt is {n_prompt} tokens; max_model_len is {self.max_model_len}, which leaves "
                "no room for an output token",
                "prompt",
            )
        room = self.max_model_len - n_prompt
        samples = num_samples(params)
        field = "best_of" if samples > params.n else "n"
        if params.max_tokens is None:  # all the room: also what the pool can hold
            room = self._pool_room(n_prompt, room, samples, params.use_beam_search)
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room:
            raise ContextLengthExceededError(
                f"max_tokens: prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})",
                "max_tokens",
            )
        if samples > self.config.max_num_seqs:
            # The group's sequences run together: more than one step's batch would never run.
            raise ValueError(
                f"{field} must be <= max_num_seqs ({self.config.max_num_seqs}), got {samples}"
            )
        self.kv.check_request_fits(n_prompt, max_tokens, samples, params.use_beam_search, field)
        return max_tokens

    def _pool_room(self, n_prompt: int, room: int, samples: int, beams: bool) -> int:
        """The largest ``max_tokens`` <= ``room`` that the KV pool accepts for this request
        (``check_request_fits``, which grows with ``max_tokens``), by bisection; ``room`` when
        not even 1 fits (the caller's check then names the limit). A pool smaller than
        ``max_model_len`` (a small ``kv_cache_memory``, a long-context model) would otherwise
        refuse every request that asks for all the room (``max_tokens=None``)."""
        lo, hi = 0, room
        while lo < hi:
            mid = (lo + hi + 1) // 2
            try:
                self.kv.check_request_fits(n_prompt, mid, samples, beams)
                lo = mid
            except ContextLengthExceededError:
                hi = mid - 1
        return lo or room

    def _validate_pooling(self, n_prompt: int, params: SamplingParams) -> int:
        """A pooling request: one sequence, no beam search; the prompt alone must fit in
        ``max_model_len`` and in the pool (nothing is generated). Returns 0 (max_tokens).

        Raises:
            ValueError / ContextLengthExceededError: naming ``n`` / ``best_of`` /
                ``use_beam_search`` / ``prompt``.
        """
        if params.n != 1 or (params.best_of or 1) != 1:
            raise ValueError("n and best_of must be 1 for a pooling request")
        if params.use_beam_search:
            raise ValueError("use_beam_search is not supported for a pooling request")
        if n_prompt > self.max_model_len:
            raise ContextLengthExceededError(
                f"prompt is {n_prompt} tokens; max_model_len is {self.max_model_len}", "prompt"
            )
        self.kv.check_request_fits(n_prompt, 0, 1, False)  # names "prompt"
        return 0

    def process(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> SequenceGroup:
        """Tokenize (a text prompt), validate and build the request's ``SequenceGroup``.

        Args:
            request_id: the caller's id (uniqueness is the engine's check).
            prompt: text or token ids.
            params: sampling parameters.
            arrival_time: ``time.monotonic()`` seconds; default now.
            cache_salt: requests with different salts never share prefix-cache blocks.
            priority: the group's scheduling priority (lower = more urgent; checked by the
                engine).

        Returns:
            A group of one waiting sequence: seed ``params.seed`` or one drawn from the engine's
            seeded generator, ``max_num_tokens`` = prompt + effective max_tokens, a detokenizer
            when ``params.detokenize``, a ``BeamSearch`` of width ``max(n, best_of)`` for beam
            search, and an empty prompt-logprobs list (first position None) when asked (then
            the sequence takes no prefix-cache hits: ``Sequence.use_cached_prefix``).

        Raises:
            ValueError: see ``validate``.
        """
        if isinstance(prompt, str):
            prompt_text: str | None = prompt
            token_ids = self.tokenize(prompt) if prompt else []
        else:
            prompt_text = None
            token_ids = token_id_list(prompt)
        max_tokens = self.validate(token_ids, params)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        key = self._prompt_key(len(token_ids)) if self._prompt_key else None
        seq = Sequence(next(self._seq_ids), token_ids, seed, prefix_cache_extra(cache_salt, key))
        seq.max_num_tokens = len(token_ids) + max_tokens
        # Prompt logprobs need the logits of every prompt position, and pooling the hidden state
        # of every position: no prefix-cache hits.
        seq.use_cached_prefix = params.prompt_logprobs is None and params.pooling is None
        if params.detokenize and params.pooling is None:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
        group = SequenceGroup(
            request_id=request_id,
            seqs=[seq],
            sampling_params=params,
            prompt=prompt_text,
            arrival_index=next(self._arrivals),
            metrics=RequestMetrics(arrival_time if arrival_time is not None else time.monotonic()),
            max_tokens=max_tokens,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            priority=priority,
        )
        if params.use_beam_search:
            group.beam = BeamSearch(
                beam_width=num_samples(params),
                length_penalty=params.length_penalty,
                early_stopping=params.early_stopping,
                max_tokens=max_tokens,
                eos_token_ids=[] if params.ignore_eos else self.eos_token_ids,
                vocab_size=self.vocab_size,
            )
        return group


def token_id_list(ids: Any) -> list[Any]:
    """Prompt token ids as a list, those given as numpy / torch integer scalars (an array's
    items) as Python ints, which ``validate`` takes; anything else as it is, for ``validate``
    to name (a bool, of any type, stays a bool: refused).

    Raises:
        ValueError: naming ``prompt`` when ``ids`` is not iterable (a 0-d array).
    """
    try:
        items = list(ids)
    except TypeError:
        raise ValueError(
            f"prompt must be a string or a sequence of token ids, got {type(ids).__name__}"
        ) from None
    out: list[Any] = []
    for t in items:
        if not isinstance(t, (int, bool)) and "bool" not in str(getattr(t, "dtype", "")):
            with contextlib.suppress(TypeError):  # not an integer: validate names it
                t = operator.index(t)
        out.append(t)
    return out
