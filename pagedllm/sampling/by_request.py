"""Sampling that keeps one request's failure its own (the engine's, the speculator's and the draft
model's sampling calls): the call over the whole batch, and only if that raises, each request's
rows again on their own."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from pagedllm.sampling.sampler import Sampler, SamplerOutput, SamplingBatch

if TYPE_CHECKING:
    from pagedllm.sequence import SequenceGroup

T = TypeVar("T")


def by_request(
    fn: Callable[[torch.Tensor, SamplingBatch], T],
    logits: torch.Tensor,
    batch: SamplingBatch,
    row_groups: list[SequenceGroup],
    fail: Callable[[SequenceGroup, Exception], None],
) -> list[tuple[list[int] | None, T]]:
    """``fn(logits, batch)``; if that raises, ``fn`` on each request's rows alone (row ``i``
    belongs to ``row_groups[i]``), and a request whose own rows raise is handed to ``fail``, so
    that one request's failure is its own. A row's result never depends on the batch it is in
    (counter-based seeds, per-row operations), so the others get what the batch would have given
    them.

    Args:
        logits: [B, vocab] float logits; batch: their B rows; row_groups: B request groups.

    Returns:
        ``[(None, result)]`` when the whole batch went through (no extra work on that path);
        else ``(rows, result)`` per request that did not fail, ``rows`` its row indices in
        order.
    """
    try:
        return [(None, fn(logits, batch))]
    except Exception:  # noqa: BLE001 - find whose rows raise; the others go on
        pass
    rows_of: dict[int, list[int]] = {}
    for i, group in enumerate(row_groups):
        rows_of.setdefault(id(group), []).append(i)
    parts: list[tuple[list[int] | None, T]] = []
    for rows in rows_of.values():
        try:
            parts.append(
                (rows, fn(logits[torch.tensor(rows, device=logits.device)], batch.select(rows)))
            )
        except Exception as exc:  # noqa: BLE001 - this request's failure alone
            fail(row_groups[rows[0]], exc)
    return parts


def sample_by_request(
    sampler: Sampler,
    logits: torch.Tensor,
    batch: SamplingBatch,
    row_groups: list[SequenceGroup],
    fail: Callable[[SequenceGroup, Exception], None],
) -> SamplerOutput:
    """``sampler(logits, batch)`` through :func:`by_request` (``fail`` is
    ``EngineCore._fail_request``, which sets the request's ``error``).

    Args:
        logits: [B, vocab] float logits, as ``Sampler.__call__`` takes them.
        batch: B rows; row_groups: B request groups.

    Returns:
        The output; a failed request's rows hold placeholders (token 0, logprob 0.0), for the
        caller to skip (its ``group.error`` is set).
    """
    parts = by_request(sampler, logits, batch, row_groups, fail)
    if parts and parts[0][0] is None:
        return parts[0][1]
    n = len(row_groups)
    out = SamplerOutput([0] * n, [0.0] * n, [0] * n, [None] * n)
    for rows, part in parts:
        assert rows is not None
        for j, i in enumerate(rows):
            out.sampled_token_ids[i] = part.sampled_token_ids[j]
            out.sampled_logprobs[i] = part.sampled_logprobs[j]
            out.sampled_ranks[i] = part.sampled_ranks[j]
            out.top_logprobs[i] = part.top_logprobs[j]
    return out
