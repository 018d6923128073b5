"""What the scheduler decides for one step, and the only thing workers receive: each scheduled
sequence's work (``ScheduledSequence``) and the step's block copies, swaps and preemptions
(``SchedulerOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScheduledSequence:
    """One sequence's work in a step.

    Attributes:
        seq_id: the sequence.
        token_ids: the tokens to compute this step (their K/V get written).
        start_pos: position of ``token_ids[0]`` (= ``num_computed_tokens`` before the step).
        block_table: physical block ids covering positions ``0 .. start_pos + len(token_ids) - 1``.
        do_sample: True when this step reaches the end of the sequence, so a token is sampled
            from the logits at its last position.
        prompt_logprobs: True when the logits of every computed prompt position are wanted.
        pool: a pooling (embedding) request: the final hidden states of every computed
            position are wanted, and nothing is sampled (``do_sample`` is False).
        num_spec_tokens: the last ``num_spec_tokens`` of ``token_ids`` are speculative
            (proposed, not yet in the sequence): the logits of the last ``num_spec_tokens + 1``
            positions are wanted to verify them (``spec_decode.verify``).
        num_prompt_tokens: the sequence's prompt length (RoPE types whose frequencies depend on
            the length read it: ``layers.rope_scaling.frequency_length``); None: its length
            after the step stands in.
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    do_sample: bool
    prompt_logprobs: bool = False
    pool: bool = False
    num_spec_tokens: int = 0
    num_prompt_tokens: int | None = None


@dataclass
class SchedulerOutput:
    """The scheduler's decision for one step; the only thing workers receive.

    Attributes:
        scheduled: (request_id, sequence work) in batch order.
        num_batched_tokens: total tokens computed this step.
        blocks_to_copy: (src, dst) copy-on-write pairs to apply before the forward pass.
        blocks_to_swap_in / blocks_to_swap_out: (src, dst) block moves between pools.
        preempted: request ids preempted (by recompute) during this step's scheduling.
        length_capped: request ids whose unfinished sequences were finished by length because
            they could not grow even alone in the pool (their blocks are freed with the
            finished groups after the step).
    """

    scheduled: list[tuple[str, ScheduledSequence]] = field(default_factory=list)
    num_batched_tokens: int = 0
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    length_capped: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """Whether nothing was scheduled (no forward pass this step)."""
        return not self.scheduled
