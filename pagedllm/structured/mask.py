"""Token bitmasks: the allowed-next-token sets of a batch, applied to its logits in one op.

A bitmask row is ``ceil(V / 32)`` int32 words; bit ``j % 32`` of word ``j // 32`` is set when
token ``j`` is allowed (the layout xgrammar and llguidance both fill).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_BITS = 32


def bitmask_width(vocab_size: int) -> int:
    """Number of int32 words of one bitmask row for ``vocab_size`` tokens."""
    return (vocab_size + _BITS - 1) // _BITS


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 bitmask -> [R, vocab_size] bool (True = allowed).

    Raises:
        ValueError: ``bitmask`` is not 2-D int32 with at least ``bitmask_width(vocab_size)``
            columns.
    """
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be [R, W] int32, got {tuple(bitmask.shape)} {bitmask.dtype}")
    if bitmask.shape[1] < bitmask_width(vocab_size):
        raise ValueError(
            f"bitmask has {bitmask.shape[1]} words, {bitmask_width(vocab_size)} needed for "
            f"{vocab_size} tokens"
        )
    shifts = torch.arange(_BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # arithmetic shift; & 1 keeps bit 31 right
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


@dataclass
class TokenBitmask:
    """The allowed next tokens of the constrained rows of a batch.

    Attributes:
        bitmask: [B, ceil(V / 32)] int32, one row per logits row (only ``rows`` are read).
        rows: the constrained logits rows (ascending, distinct).
    """

    bitmask: torch.Tensor
    rows: list[int]


def apply_token_bitmask_(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None
) -> torch.Tensor:
    """Set the logits of disallowed tokens to ``-inf`` IN PLACE, for the whole batch at once.

    Args:
        logits: [B, V'] float logits; only the first ``min(V', 32 * W)`` columns are masked by
            the bits, any column past the bitmask is disallowed.
        bitmask: [B, W] int32, row ``i`` for logits row ``i``.
        rows: the distinct rows to mask; None = all rows.

    Returns:
        ``logits`` (modified).

    Uses xgrammar's fused kernel (a single pass over the masked rows) when xgrammar is
    installed and the logits are float32 on the CPU, else the torch unpack below.
    """
    V = logits.shape[1]
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and _xgrammar_kernel():
        import xgrammar as xgr

        width = min(V, bitmask.shape[1] * _BITS)
        if width < V:
            logits[rows if rows is not None else slice(None), width:] = float("-inf")
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=width, indices=rows)
        return logits
    return apply_token_bitmask_torch_(logits, bitmask, rows)


def apply_token_bitmask_torch_(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None
) -> torch.Tensor:
    """:func:`apply_token_bitmask_` in plain torch (unpack the bits, one ``masked_fill_``): the
    fallback without xgrammar, and its reference in tests. Same arguments and result."""
    V = logits.shape[1]
    idx = None if rows is None else torch.tensor(rows, dtype=torch.int64, device=logits.device)
    if idx is not None:
        bitmask = bitmask.index_select(0, idx.to(bitmask.device))
    allowed = unpack_bitmask(bitmask, min(V, bitmask.shape[1] * _BITS)).to(logits.device)
    if allowed.shape[1] < V:
        pad = torch.zeros(allowed.shape[0], V - allowed.shape[1], dtype=torch.bool)
        allowed = torch.cat([allowed, pad.to(allowed.device)], dim=1)
    if idx is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        sub = logits.index_select(0, idx).masked_fill_(~allowed, float("-inf"))
        logits.index_copy_(0, idx, sub)
    return logits


def _xgrammar_kernel() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True
