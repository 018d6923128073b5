"""Server admission control: which new requests ``AsyncLLMEngine`` refuses at once (503).

Two policies (``EngineConfig.admission``):

- ``queue`` (default): refuse a request when ``max_waiting_requests`` requests wait already
  (the published waiting count plus the adds the engine thread has not taken yet). Under
  overload the queue stays full, so an admitted request waits behind a full batch: its time to
  first token grows by up to one request's duration.
- ``slots``: also refuse a request that could not start at the next step: the live requests'
  sequences (each request counts ``max(n, best_of)``, the batch slots it takes when it starts)
  plus its own exceed ``max_num_seqs``, or the free KV blocks (as last published) cannot hold
  its prompt. An admitted request then starts at the next step boundary, so its TTFT stays near
  the unloaded value, and a slot freed by a finished request goes to the next arrival. The cost:
  a slot idles from a request's end until the next arrival (at 3x the sustainable rate of
  16-token requests measured: goodput in docs/benchmarks.md, "Overload").

The ``slots`` count is exact from the event loop's view: a request holds its sequences from
``admit`` until the engine thread delivers its finished output (or its consumer goes away),
which is the step boundary at which the scheduler frees them; it does not depend on the
counters, which are published only once per step.
"""

from __future__ import annotations

from pagedllm.config import ADMISSION_POLICIES
from pagedllm.engine.kv_snapshot import EngineCounters
from pagedllm.sampling_params import SamplingParams

__all__ = ["ADMISSION_POLICIES", "AdmissionControl", "QueueFullError", "request_width"]


class QueueFullError(RuntimeError):
    """A new request is refused for overload (the server answers 503 with ``Retry-After``):
    ``max_waiting_requests`` requests wait already, or (``admission="slots"``) no batch slot or
    KV room is free for it."""


def request_width(params: SamplingParams) -> int:
    """Batch slots (sequences) a request takes once it starts: ``max(1, n, best_of)`` (the
    scheduler's width of a group that has not sampled yet)."""
    return max(1, params.n, params.best_of or 1)


class AdmissionControl:
    """The event loop's admission decision (not thread-safe: call it from the event loop only).

    Args:
        policy: ``"queue"`` or ``"slots"`` (see the module docstring).
        max_waiting_requests: most waiting requests (both policies); None = unbounded.
        max_num_seqs: the scheduler's most sequences per step (``slots``).

    Raises:
        ValueError: naming ``admission`` for an unknown policy.
    """

    def __init__(self, policy: str, max_waiting_requests: int | None, max_num_seqs: int) -> None:
        if policy not in ADMISSION_POLICIES:
            raise ValueError(f"admission must be one of {ADMISSION_POLICIES}, got {policy!r}")
        self.policy = policy
        self.max_waiting_requests = max_waiting_requests
        self.max_num_seqs = max_num_seqs
        self._live_seqs: dict[str, int] = {}  # request id -> sequences it holds

    @property
    def live_seqs(self) -> int:
        """Sequences held by admitted requests that have not finished (as the loop sees them)."""
        return sum(self._live_seqs.values())

    def check(
        self,
        params: SamplingParams,
        counters: EngineCounters,
        pending_adds: int,
        prompt_len: int | None,
    ) -> None:
        """Refuse a new request, or return None to admit it.

        Args:
            params: its sampling parameters (their ``n`` / ``best_of`` give its width).
            counters: the newest published engine counters (waiting count, free KV blocks).
            pending_adds: adds queued for the engine thread and not yet taken by it.
            prompt_len: its prompt in tokens, or None when not tokenized yet (then the KV room
                is not checked).

        Raises:
            QueueFullError: saying which limit is reached (``max_waiting_requests``,
                ``max_num_seqs`` or KV blocks).
        """
        limit = self.max_waiting_requests
        if limit is not None and counters.num_waiting + pending_adds >= limit:
            raise QueueFullError(
                f"the server is overloaded: {limit} requests are waiting already "
                "(max_waiting_requests); retry later"
            )
        if self.policy != "slots":
            return
        width = request_width(params)
        if self.live_seqs + width > self.max_num_seqs:
            raise QueueFullError(
                f"the server is overloaded: {self.live_seqs} of max_num_seqs "
                f"{self.max_num_seqs} batch slots are taken and this request needs {width} "
                "(admission=slots); retry later"
            )
        if prompt_len is not None and counters.block_size > 0:
            blocks = -(-prompt_len // counters.block_size)
            if counters.num_free_blocks < blocks:
                raise QueueFullError(
                    f"the server is overloaded: {counters.num_free_blocks} free KV blocks "
                    f"cannot hold a {prompt_len}-token prompt (admission=slots); retry later"
                )

    def admit(self, request_id: str, params: SamplingParams) -> None:
        """Count an admitted request's sequences until ``release``."""
        self._live_seqs[request_id] = request_width(params)

    def release(self, request_id: str) -> None:
        """The request finished, failed or was aborted: its sequences are free (idempotent)."""
        self._live_seqs.pop(request_id, None)
