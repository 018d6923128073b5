"""Sequences and sequence groups: the per-request state the scheduler and engine share.

A *sequence* is one token stream (prompt + generated tokens) with its progress counter
``num_computed_tokens`` (how many of its tokens already have K/V in the cache). A *sequence group*
is every sequence of one request (the ``n`` parallel samples or the beams of beam search); the
scheduler admits, preempts and finishes a group as a whole (paper section 4.5).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedllm.outputs import PositionLogprobs, RequestMetrics

if TYPE_CHECKING:
    from pagedllm.engine.detokenizer import IncrementalDetokenizer
    from pagedllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life; the finished values are OpenAI ``finish_reason`` s."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        """Stopped, cut at its length limit or aborted."""
        return self in _FINISHED_STATUSES  # asked ~10 times per sequence per step

    @property
    def finish_reason(self) -> str | None:
        """"stop", "length" or "abort" once finished, else None."""
        return self.value if self.is_finished else None


# Built once instead of per call; members compare by identity.
_FINISHED_STATUSES = (
    SequenceStatus.FINISHED_STOPPED,
    SequenceStatus.FINISHED_LENGTH,
    SequenceStatus.FINISHED_ABORTED,
)


class Sequence:
    """One token stream.

    Attributes:
        seq_id: engine-wide unique id; the block manager keys block tables by it.
        token_ids: prompt followed by generated tokens.
        num_prompt_tokens: length of the prompt part of ``token_ids``.
        num_computed_tokens: leading tokens whose K/V are in the cache. A step computes
            ``token_ids[num_computed_tokens : num_computed_tokens + n]``; a sample is drawn when
            that reaches the end of ``token_ids``.
        seed: seed of this sequence's counter-based random stream (see ``sampling.sampler``).
        cache_salt: extra prefix-cache key material (requests with different salts never share).
        use_cached_prefix: whether admission may take prefix-cache hits for this sequence
            (False for a request asking for ``prompt_logprobs``: every prompt position must be
            computed for its logits, vLLM's rule). Its own full blocks are still registered.
        cumulative_logprob: sum of raw-model logprobs of the generated tokens.
        max_num_tokens: the most tokens the sequence can reach (prompt + the request's
            max_tokens), set by the engine; with ``ignore_eos`` it is the true final length.
            The contiguous-cache baselines reserve by it; the memory-waste accounting uses it.
        spec_token_ids: speculative tokens proposed for the next decode step (verified by the
            target in that step; ``spec_decode``); [] when none.
    """

    def __init__(
        self, seq_id: int, prompt_token_ids: list[int], seed: int, cache_salt: bytes | None = None
    ) -> None:
        self.seq_id = seq_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.seed = seed
        self.cumulative_logprob = 0.0
        self.output_logprobs: list[PositionLogprobs] = []
        self.detokenizer: IncrementalDetokenizer | None = None
        self.output_text = ""
        self.stop_reason: int | str | None = None
        # Prefix caching: keys of the sequence's full blocks (a hash chain) and how many of its
        # blocks are registered in the cache; ``cache_salt`` separates users' caches.
        self.cache_salt = cache_salt
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0
        self.use_cached_prefix = True
        self.max_num_tokens: int | None = None
        # Speculative decoding: tokens proposed for the next step (``spec_decode``); verified
        # by the target, never part of ``token_ids`` until accepted.
        self.spec_token_ids: list[int] = []

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens."""
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt's ids (a copy)."""
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """The generated ids (a copy)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V is not in the cache yet (what the next steps compute)."""
        return len(self.token_ids) - self.num_computed_tokens

    def append_token(self, token_id: int, logprob: float) -> None:
        """Add a sampled token and its raw-model logprob (natural log) to the cumulative sum."""
        self.token_ids.append(token_id)
        self.cumulative_logprob += logprob

    def reset_for_recompute(self) -> None:
        """Forget the cached K/V (preemption by recompute); tokens and sampling state stay."""
        self.num_computed_tokens = 0
        self.num_registered_blocks = 0
        self.status = SequenceStatus.WAITING
        self.spec_token_ids = []

    def fork(self, seq_id: int, seed: int) -> Sequence:
        """A copy sharing this sequence's tokens and progress (the blocks are forked by the
        block manager); used for parallel samples and beams."""
        child = Sequence(seq_id, self.prompt_token_ids, seed, self.cache_salt)
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        child.cumulative_logprob = self.cumulative_logprob
        child.output_logprobs = list(self.output_logprobs)
        child.output_text = self.output_text
        child.num_registered_blocks = self.num_registered_blocks
        child.max_num_tokens = self.max_num_tokens
        # A sample of a request with prompt logprobs recomputes its prompt too when readmitted
        # (taking its own cached copy would duplicate the lead's freshly computed blocks).
        child.use_cached_prefix = self.use_cached_prefix
        return child

    def is_finished(self) -> bool:
        """Whether the sequence stopped, hit its length limit or was aborted."""
        return self.status.is_finished

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.name})"
        )


@dataclass
class SequenceGroup:
    """All sequences of one request, scheduled as a unit.

    Attributes:
        request_id: the caller's id.
        seqs: the group's sequences (one until parallel sampling / beam search).
        sampling_params: the request's ``SamplingParams``.
        prompt: prompt text, if given as text.
        arrival_index: engine-wide arrival counter, the FCFS priority (lower = older).
        metrics: timestamps.
        max_tokens: generated tokens allowed (``SamplingParams.max_tokens`` capped by
            ``max_model_len - prompt length``).
        prompt_logprobs: filled once the prompt has been computed, when asked.
        num_cached_tokens: prompt tokens served from the prefix cache.
        priority: scheduling priority under the ``priority`` policy (lower = served first,
            ties by ``arrival_index``); always 0 under FCFS.
        error: why the engine ended the request ("ExceptionType: message"), when an exception
            in its own part of a step did (its samples then finish "abort"); None otherwise.
    """

    request_id: str
    seqs: list[Sequence]
    sampling_params: SamplingParams
    prompt: str | None
    arrival_index: int
    metrics: RequestMetrics
    max_tokens: int = 16
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    priority: int = 0
    error: str | None = None
    # Beam search state (``engine.beam_search.BeamSearch``) and, once done, the best hypotheses.
    beam: Any = None
    beam_results: list[Any] | None = None
    # Pooling requests: the running pool (``engine.pooling.PoolingState``), then the embedding.
    pooling_state: Any = None
    embedding: list[float] | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        """The request's prompt ids (shared by every sequence)."""
        return self.seqs[0].prompt_token_ids

    def unfinished_seqs(self) -> list[Sequence]:
        """The group's sequences still generating."""
        return [s for s in self.seqs if not s.is_finished()]

    def is_finished(self) -> bool:
        """Every sample finished (beam search: the search produced its hypotheses)."""
        if self.beam is not None:
            return self.beam_results is not None
        return all(s.is_finished() for s in self.seqs)
