"""What the engine returns for a request: ``RequestOutput`` with one ``CompletionOutput`` per sample.

Shaped like vLLM's outputs so that code written for vLLM reads the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token under the raw model distribution.

    Attributes:
        logprob: natural-log probability (<= 0).
        rank: 1-based rank of the token among the vocabulary (1 = most likely).
        decoded_token: the token's text, filled when a tokenizer is at hand.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position: token id -> Logprob, holding the chosen token plus the top-k alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One sample of a request.

    Attributes:
        index: sample index within the request (0 .. n-1).
        text: generated text so far (without a matched stop string unless
            ``include_stop_str_in_output``); while the request runs, text that could still
            become a stop string is held back, so ``text`` only ever grows.
        token_ids: generated token ids.
        cumulative_logprob: sum of the raw-model log-probabilities of ``token_ids``.
        logprobs: per generated token, when ``SamplingParams.logprobs`` is set.
        finish_reason: None while running, else "stop" (EOS, stop token or stop string),
            "length" (max_tokens or max_model_len) or "abort".
        stop_reason: the stop string or stop token id that ended the sample, else None.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """Whether this sample has a ``finish_reason``."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (seconds, ``time.monotonic``) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    """Everything the engine can say about one request after a step.

    Attributes:
        request_id: the caller's id.
        prompt: the prompt text, when it was given as text.
        prompt_token_ids: the tokenized prompt.
        prompt_logprobs: per prompt token (the first is None), when asked.
        outputs: one ``CompletionOutput`` per returned sample.
        finished: True once every sample has finished.
        num_cached_tokens: prompt tokens whose KV came from the prefix cache.
        metrics: timestamps of the request.
        embedding: a pooling request's embedding (``hidden_size`` floats) once finished.
        error: set when an exception in this request's own part of a step ended it
            ("ExceptionType: message"; its samples finish "abort", the other requests go on);
            None otherwise.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)
    embedding: list[float] | None = field(default=None, repr=False)
    error: str | None = None
