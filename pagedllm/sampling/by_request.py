"""Sampling that keeps one request's failure its own (the engine's and the speculator's sampling
call): ``Sampler.__call__`` over the whole batch, and only if that raises, each request's rows
again on their own."""

from __future__ import annotations

import torch

from pagedllm.sampling.sampler import Sampler, SamplerOutput, SamplingBatch


def sample_by_request(
    sampler: Sampler, logits: torch.Tensor, batch: SamplingBatch, request_ids: list[str]
) -> tuple[SamplerOutput, dict[str, Exception]]:
    """``sampler(logits, batch)``; if that raises, each request's rows (row ``i`` belongs to
    ``request_ids[i]``) are sampled again on their own, so that one request's failure is its
    own. A row's result never depends on the batch it is in (counter-based seeds, per-row
    operations), so the others get what the batch would have given them.

    Args:
        logits: [B, vocab] float logits, as ``Sampler.__call__`` takes them.
        batch: B rows; request_ids: B request ids.

    Returns:
        The output (a failed request's rows hold placeholders: token 0, logprob 0.0) and
        request id -> the exception its rows raised (empty when the batch call worked).
    """
    try:
        return sampler(logits, batch), {}
    except Exception:  # noqa: BLE001 - find whose rows raise; the others go on
        pass
    rows_of: dict[str, list[int]] = {}
    for i, rid in enumerate(request_ids):
        rows_of.setdefault(rid, []).append(i)
    n = len(request_ids)
    out = SamplerOutput([0] * n, [0.0] * n, [0] * n, [None] * n)
    failed: dict[str, Exception] = {}
    for rid, rows in rows_of.items():
        try:
            part = sampler(logits[torch.tensor(rows, device=logits.device)], batch.select(rows))
        except Exception as exc:  # noqa: BLE001 - this request's failure alone
            failed[rid] = exc
            continue
        for j, i in enumerate(rows):
            out.sampled_token_ids[i] = part.sampled_token_ids[j]
            out.sampled_logprobs[i] = part.sampled_logprobs[j]
            out.sampled_ranks[i] = part.sampled_ranks[j]
            out.top_logprobs[i] = part.top_logprobs[j]
    return out, failed
