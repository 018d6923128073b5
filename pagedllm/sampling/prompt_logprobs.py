"""Log-probabilities of a prompt's own tokens (``SamplingParams.prompt_logprobs``, and the
completions API's ``echo`` with ``logprobs``): raw ``log_softmax`` values of each actual next
token, its rank and the top-k alternatives per position."""

from __future__ import annotations

import torch


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, k: int, lse: torch.Tensor | None = None
) -> tuple[list[float], list[int], list[list[tuple[int, float]]]]:
    """Raw log-probabilities of the actual next tokens of a prompt.

    Args:
        logits: [P, V] float32/bf16 logits, row ``j`` predicting the token after prompt position
            ``j`` (upcast to float32; not modified).
        next_token_ids: [P] int64, the actual token at position ``j + 1``.
        k: number of top entries per position (>= 0).
        lse: [P] float32 logsumexp of the rows (``Sampler.raw_logsumexp``, to match sampled
            logprobs bit for bit), or None: ``torch.logsumexp``.

    Returns:
        ``(logprobs [P], ranks [P], top [P])``: natural-log probability of each next token under
        ``log_softmax(logits)``, its 1-based rank (1 + count of strictly larger logits), and per
        position the top-``k`` ``(token_id, logprob)`` pairs sorted by decreasing logprob.

    Raises:
        ValueError: shape mismatch or negative ``k``.
    """
    if logits.dim() != 2 or next_token_ids.shape != (logits.shape[0],):
        raise ValueError(
            f"logits must be [P, V] and next_token_ids [P], got {tuple(logits.shape)} and "
            f"{tuple(next_token_ids.shape)}"
        )
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    raw = logits.float()
    P, V = raw.shape
    if P == 0:
        return [], [], []
    ids = next_token_ids.to(device=raw.device, dtype=torch.int64)
    if lse is None:
        lse = torch.logsumexp(raw, dim=-1)
    chosen = raw.gather(1, ids[:, None]).squeeze(1)
    lps = (chosen - lse).tolist()
    ranks = (torch.count_nonzero(raw > chosen[:, None], dim=-1) + 1).tolist()
    if k == 0:
        return lps, ranks, [[] for _ in range(P)]
    vals, idx = raw.topk(min(k, V), dim=-1)
    vals_l = (vals - lse[:, None]).tolist()
    idx_l = idx.tolist()
    top = [list(zip(idx_l[j], vals_l[j], strict=True)) for j in range(P)]
    return lps, ranks, top
