"""The LM head: hidden states of the sampled positions -> vocabulary logits (float32), with an
optional bias (Phi-1/1.5/2) and an optional final soft cap (Gemma 2:
``cap * tanh(logits / cap)``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import TensorParallelGroup
from pagedllm.model.layers.parallel import vocab_parallel_logits
from pagedllm.model.packed_linear import PackedLinear


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)`` in place (Gemma 2's logit soft-capping); ``x`` when None."""
    if cap is None:
        return x
    return x.div_(cap).tanh_().mul_(cap)


def lm_head_logits(
    h: torch.Tensor,
    weight: torch.Tensor,
    packed: nn.Module | None,
    group: TensorParallelGroup | None,
    vocab_size: int,
    final_logit_softcapping: float | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits of the final hidden states.

    Args:
        h: [S, d] normalized hidden states of the sampled positions.
        weight: [V, d] LM-head rows (this rank's [ceil(V / tp), d] shard under a group).
        packed: the prepacked head (``PackedLinear``, or ``Int8Linear``) or None.
        group: tensor-parallel group or None.
        vocab_size: V, to drop padding rows of the last shard.
        final_logit_softcapping: the soft cap, or None.
        bias: [V] LM-head bias (this rank's [ceil(V / tp)] shard under a group), added in
            float32 before the soft cap, or None.

    Returns:
        [S, V] float32; under tensor parallelism only on rank 0, the other ranks return an empty
        [S, 0] tensor.
    """
    if group is None:
        if isinstance(packed, PackedLinear):
            logits = packed.forward_float32(h)  # a bf16 model's logits not rounded to bf16
        else:
            logits = packed(h) if packed is not None else F.linear(h, weight)
        logits = logits.float()  # a fresh tensor: the bias and the cap go in place
        if bias is not None:
            logits.add_(bias.float())
        return soft_cap(logits, final_logit_softcapping)
    shard_packed = packed if isinstance(packed, PackedLinear) else None
    full = vocab_parallel_logits(h, weight, group, vocab_size, shard_packed, bias)
    if full is None:
        return h.new_empty(h.shape[0], 0)
    return soft_cap(full.float(), final_logit_softcapping)
