"""Verification of a draft model's sampled proposals by rejection sampling.

A draft model proposes from a distribution ``q`` (not one-hot), so "accept while the target's
sample equals the draft" would not follow the target distribution ``p``. For sampled requests
with draft probabilities the verifier uses :func:`pagedllm.spec_decode.rejection.rejection_sample`
instead (Leviathan et al. 2023, algorithm 1; Chen et al. 2023, algorithm 2): draft ``x_j`` is
accepted with probability ``min(1, p_j(x_j) / q_j(x_j))``, the first rejected position emits a
token drawn from ``norm(max(0, p - q))``, and a fully accepted run emits a bonus token from
``p_{k+1}``. ``p`` is the sampler's own processed distribution (``Sampler.probs``: penalties,
``min_tokens``, temperature, top-k / top-p / min-p) of each row *as if* the drafts before it had
been generated, ``q`` the draft's distribution processed the same way. Randomness is
counter-based with the request's seed (``rejection.rejection_seed``), so a seeded request is
reproducible. Greedy requests keep the ordinary rule (longest argmax-equal prefix plus one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedllm.sampling.sampler import Sampler, SamplerOutput, SamplingBatch
from pagedllm.spec_decode.rejection import rejection_sample

if TYPE_CHECKING:
    from pagedllm.sequence import Sequence, SequenceGroup


def verify_with_draft_probs(
    spec: list[tuple[int, int, int]],
    drafts: dict[int, list[int]],
    logits: torch.Tensor,
    batch: SamplingBatch,
    out: SamplerOutput,
    sampler: Sampler,
    seqs: dict[int, tuple[Sequence, SequenceGroup]],
    draft_probs: dict[int, torch.Tensor],
) -> dict[int, int]:
    """Rejection-sample the sequences of ``spec`` that have draft probabilities.

    Args:
        spec: (seq_id, first logits row in the step, k) of every speculating sequence; their
            ``k + 1`` rows are consecutive in ``logits`` / ``batch`` / ``out``, in this order.
        drafts: seq_id -> its k proposed tokens.
        logits: [sum(k + 1), V] float32 target logits of those rows.
        batch / out: the rows' sampling batch and the ordinary sampler's output for them;
            ``out`` is overwritten at the rows of every rejection-sampled sequence
            (accepted drafts, then the recovered or bonus token, with their raw logprobs).
        sampler: the engine's sampler.
        seqs: the engine's seq_id -> (sequence, group) map (seed, output position).
        draft_probs: seq_id -> [k, V] float32 draft distributions, for sampled sequences only.

    Returns:
        seq_id -> accepted draft count, for the sequences handled here (the others keep the
        ordinary comparison of ``out`` with their drafts).
    """
    chosen: list[tuple[int, int, int]] = []  # (seq_id, first row in logits, k)
    base = 0
    for seq_id, _, k in spec:
        if seq_id in draft_probs:
            chosen.append((seq_id, base, k))
        base += k + 1
    if not chosen:
        return {}
    rows = [b + j for _, b, k in chosen for j in range(k + 1)]
    dev = logits.device
    p_rows = sampler.probs(logits[torch.tensor(rows, device=dev)], batch.select(rows))
    n, k_max, vocab = len(chosen), max(k for _, _, k in chosen), p_rows.shape[1]
    target = torch.zeros(n, k_max + 1, vocab, dtype=torch.float32, device=dev)
    q = torch.zeros(n, k_max, vocab, dtype=torch.float32, device=dev)
    tokens = torch.full((n, k_max), -1, dtype=torch.int64, device=dev)
    off = 0
    for i, (seq_id, _, k) in enumerate(chosen):
        target[i, : k + 1] = p_rows[off : off + k + 1]
        q[i, :k] = draft_probs[seq_id][:k]
        tokens[i, :k] = torch.tensor(drafts[seq_id], dtype=torch.int64, device=dev)
        off += k + 1
    emitted, num_accepted = rejection_sample(
        target,
        tokens,
        torch.tensor([k for _, _, k in chosen], dtype=torch.int64, device=dev),
        q,
        [seqs[s][0].seed for s, _, _ in chosen],
        [seqs[s][0].num_output_tokens for s, _, _ in chosen],
    )
    accepted = num_accepted.tolist()
    emitted_ids = emitted.tolist()
    patch_rows: list[int] = []
    patch_ids: list[int] = []
    for i, (_, b, _) in enumerate(chosen):
        for j in range(accepted[i] + 1):
            patch_rows.append(b + j)
            patch_ids.append(emitted_ids[i][j])
    fresh = sampler.output_for(
        logits[torch.tensor(patch_rows, device=dev)],
        patch_ids,
        [batch.params[r] for r in patch_rows],
    )
    for i, r in enumerate(patch_rows):
        out.sampled_token_ids[r] = fresh.sampled_token_ids[i]
        out.sampled_logprobs[r] = fresh.sampled_logprobs[i]
        out.sampled_ranks[r] = fresh.sampled_ranks[i]
        out.top_logprobs[r] = fresh.top_logprobs[i]
    return {s: accepted[i] for i, (s, _, _) in enumerate(chosen)}
