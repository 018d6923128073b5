"""Rejection sampling of speculative proposals (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding", algorithm 1 and appendix A.1; Chen et al. 2023,
"Accelerating Large Language Model Decoding with Speculative Sampling", algorithm 2).

For a row with drafts ``x_0 .. x_{n-1}`` (``n = num_draft``), draft distributions ``q_j`` and
target distributions ``p_j`` (``p_n`` is the target's distribution after the last draft):

1. draft ``j`` is accepted when ``u_j < p_j(x_j) / q_j(x_j)`` (probability ``min(1, p/q)``),
   drafts are taken left to right and the first rejection stops the row;
2. at the first rejected position ``a`` the row emits a token drawn from the residual
   ``max(0, p_a - q_a)`` normalised; when all ``n`` drafts are accepted it emits a bonus token
   drawn from ``p_n``.

Every emitted token then follows the target distribution exactly (Leviathan et al., theorem 3.5).
Deterministic proposers (n-gram, suffix) are the special case ``q_j = one_hot(x_j)``: accept with
probability ``p_j(x_j)``, and on rejection draw from ``p_j`` with ``x_j`` removed.

Randomness is counter-based like :mod:`pagedllm.sampling.sampler` (no generator state, batch
independent): a row with seed ``s`` whose first emitted token has output position ``t`` uses, at
draft position ``j``, ``u_j = counter_uniform(s', t + j, -1)`` and draws the recovered / bonus
token at position ``a`` with the sampler's exponential race ``argmax_v r(v) / -log(w_v)``,
``w_v = counter_uniform(s', t + a, v)``. ``s' = rejection_seed(s)`` is a domain-separated seed:
a draft model that samples its proposals with the request's own seed through the ordinary
sampler draws ``counter_uniform(s, t + j, v)``, and reusing those uniforms here would correlate
the recovered token with the draft token and bias the output. Every position's uniforms are
consumed by at most one call (the next call of the row starts at ``t + a + 1``), so a seeded
request is reproducible, including after preemption and recompute.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedllm.sampling.sampler import _U64, _mix64_py, _to_i64, counter_uniform

#: XOR-ed into the mixed seed to separate the rejection sampler's stream from the sampler's.
_REJECTION_DOMAIN = 0x2545F4914F6CDD1D
#: rows x vocab elements hashed at once for the recovered / bonus race (bounds temporary memory).
_RACE_CHUNK_ELEMENTS = 1 << 22


def rejection_seed(seed: int) -> int:
    """The seed of the rejection sampler's uniforms for a request with ``seed`` (any Python int).

    Returns a signed int64 value, ready for :func:`counter_uniform`. It differs from the
    request's own stream (used by :class:`pagedllm.sampling.sampler.Sampler`, hence by a draft
    model that samples with the request's seed) so that acceptance uniforms and the recovered
    token's race are independent of how the draft tokens were drawn.
    """
    return _to_i64(_mix64_py((seed & _U64) ^ _REJECTION_DOMAIN))


def _check_tensors(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
) -> None:
    """Raise ``ValueError`` naming the first tensor whose shape, dtype or values are wrong."""
    if target_probs.dim() != 3 or target_probs.shape[1] < 1 or not target_probs.is_floating_point():
        raise ValueError(
            "target_probs must be a float tensor [num_seqs, k + 1, vocab], got "
            f"{target_probs.dtype} {tuple(target_probs.shape)}"
        )
    n, k1, vocab = target_probs.shape
    k = k1 - 1
    if draft_token_ids.shape != (n, k) or draft_token_ids.dtype != torch.int64:
        raise ValueError(
            f"draft_token_ids must be int64 [{n}, {k}] (num_seqs, k), got "
            f"{draft_token_ids.dtype} {tuple(draft_token_ids.shape)}"
        )
    if num_draft.shape != (n,) or num_draft.dtype != torch.int64:
        raise ValueError(
            f"num_draft must be int64 [{n}], got {num_draft.dtype} {tuple(num_draft.shape)}"
        )
    if draft_probs is not None and (
        draft_probs.shape != (n, k, vocab) or not draft_probs.is_floating_point()
    ):
        raise ValueError(
            f"draft_probs must be a float tensor [{n}, {k}, {vocab}] or None, got "
            f"{draft_probs.dtype} {tuple(draft_probs.shape)}"
        )
    if n == 0:
        return
    if int(num_draft.min()) < 0 or int(num_draft.max()) > k:
        raise ValueError(f"num_draft values must be in [0, {k}], got {num_draft.tolist()}")
    if k > 0:
        used = torch.arange(k, device=num_draft.device)[None, :] < num_draft[:, None]
        ids = draft_token_ids[used]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(
                f"draft_token_ids must be in [0, {vocab}) for the first num_draft positions"
            )


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    seeds: Sequence[int],
    steps: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify the drafts of every row and emit accepted drafts plus one target token per row.

    See the module docstring for the algorithm and the counters of the uniforms. All rows are
    processed with batched torch ops: one ``[num_seqs * k]`` hash for the acceptance tests and
    one ``[num_seqs, vocab]`` hash for the recovered / bonus race.

    Args:
        target_probs: [num_seqs, k + 1, vocab] float32 target probabilities, already after
            temperature / top-k / top-p / min-p; row ``i`` position ``j`` is the distribution of
            the token after draft ``j - 1`` (position 0: after the last accepted token).
            Positions beyond ``num_draft[i]`` are ignored.
        draft_token_ids: [num_seqs, k] int64 proposed tokens; entries at positions
            ``>= num_draft[i]`` are padding (conventionally -1) and ignored.
        num_draft: [num_seqs] int64 number of real drafts per row, in ``[0, k]``; a row with 0
            just samples one token from ``target_probs[i, 0]``.
        draft_probs: [num_seqs, k, vocab] float draft probabilities ``q`` (a draft model), or
            None for deterministic proposals (``q = one_hot(draft)``: n-gram, suffix).
        seeds: [num_seqs] each row's request seed (any Python int).
        steps: [num_seqs] output position (number of tokens generated so far) of the first
            token the row would emit, >= 0.

    Returns:
        ``(output_token_ids, num_accepted)``: [num_seqs, k + 1] int64, row ``i`` holding its
        ``num_accepted[i]`` accepted drafts then one recovered or bonus token, padded with -1;
        and [num_seqs] int64 accepted draft counts (so row ``i`` emits ``num_accepted[i] + 1``
        tokens).

    Raises:
        ValueError: naming the argument when a shape, dtype, count or token id is wrong.
    """
    _check_tensors(target_probs, draft_token_ids, num_draft, draft_probs)
    n, k1, vocab = target_probs.shape
    if len(seeds) != n:
        raise ValueError(f"seeds has {len(seeds)} entries, expected num_seqs = {n}")
    if len(steps) != n:
        raise ValueError(f"steps has {len(steps)} entries, expected num_seqs = {n}")
    if n and min(steps) < 0:
        raise ValueError(f"steps must be >= 0, got {min(steps)}")
    k = k1 - 1
    dev = target_probs.device
    out = torch.full((n, k1), -1, dtype=torch.int64, device=dev)
    if n == 0:
        return out, torch.zeros(0, dtype=torch.int64, device=dev)
    p_all = target_probs.float()
    rows = torch.arange(n, device=dev)
    seed_t = torch.tensor([rejection_seed(s) for s in seeds], dtype=torch.int64, device=dev)
    step_t = torch.tensor(list(steps), dtype=torch.int64, device=dev)
    offsets = torch.arange(k, device=dev)
    used = offsets[None, :] < num_draft[:, None]  # [n, k] real drafts (not padding)
    drafts = torch.where(used, draft_token_ids, 0)  # padding reads column 0; masked below

    if k > 0:
        # ---- acceptance tests: u * q(x) < p(x), i.e. u < p / q without dividing by 0 --------
        p_x = p_all[:, :k].gather(2, drafts[:, :, None])[:, :, 0]
        if draft_probs is None:
            q_x = torch.ones_like(p_x)
        else:
            q_x = draft_probs.float().gather(2, drafts[:, :, None])[:, :, 0]
        u = counter_uniform(
            seed_t.repeat_interleave(k),
            (step_t[:, None] + offsets[None, :]).reshape(-1),
            torch.full((n * k, 1), -1, dtype=torch.int64, device=dev),
        ).view(n, k)
        accepted = (u * q_x < p_x) & used
        num_accepted = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)
        keep = offsets[None, :] < num_accepted[:, None]
        out[:, :k] = torch.where(keep, draft_token_ids, out[:, :k])
    else:
        num_accepted = torch.zeros(n, dtype=torch.int64, device=dev)

    # ---- recovered (first rejection) or bonus (all accepted) token at position a ----------
    resid = p_all[rows, num_accepted].clone()  # [n, vocab]
    rejected = num_accepted < num_draft
    if bool(rejected.any()):
        r_rows = rows[rejected]
        r_pos = num_accepted[rejected]
        if draft_probs is None:
            resid[r_rows, drafts[r_rows, r_pos]] = 0.0
        else:
            q_a = draft_probs[r_rows, r_pos].float()
            resid[r_rows] = (resid[r_rows] - q_a).clamp_(min=0.0)
        # p <= q everywhere only through rounding (then the rejection had probability ~0):
        # fall back to p so the row still draws from a valid distribution.
        empty = r_rows[resid[r_rows].sum(dim=1) <= 0]
        if empty.numel():
            resid[empty] = p_all[empty, num_accepted[empty]]
    race_steps = step_t + num_accepted
    final = torch.empty(n, dtype=torch.int64, device=dev)
    chunk = max(1, _RACE_CHUNK_ELEMENTS // vocab)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        expo = counter_uniform(seed_t[s:e], race_steps[s:e], vocab).log_().neg_()  # Exp(1)
        final[s:e] = (resid[s:e] / expo).argmax(dim=1)
    out[rows, num_accepted] = final
    return out, num_accepted
