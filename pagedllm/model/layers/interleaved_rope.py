"""Interleaved RoPE on the rotate-half kernels, by a load-time permutation of q/k rows.

Some models (Cohere, ERNIE 4.5, GLM) rotate interleaved pairs of each head's dimensions,
(2i, 2i + 1) at frequency i (GPT-J style), where Llama's rotate-half layout pairs (i, i + R/2).
Permuting the first R rows of every q and k head once at load time, the even dimensions first,
then the odd ones, makes rotate-half RoPE on the permuted rows equal the interleaved rotation of
the original ones; q and k share the permutation, so their dot products, hence the attention,
are unchanged (v and o are untouched). The rotary stays the C++ kernel and the fused layer op.
A q/k norm before RoPE (Cohere's per-head LayerNorms) has its weight's dimensions permuted the
same way: its mean and variance over a head do not depend on the order of the dimensions.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def interleaved_to_half_order(head_dim: int, rotary_dim: int | None = None) -> torch.Tensor:
    """[head_dim] int64: a head's dimensions in the order that makes rotate-half RoPE over the
    first ``rotary_dim`` (default: all) equal the interleaved one: position i of the first
    ``rotary_dim / 2`` holds dimension 2i, position i + rotary_dim / 2 holds 2i + 1, and the
    unrotated dimensions follow in place."""
    r = head_dim if rotary_dim is None else rotary_dim
    return torch.cat((torch.arange(0, r, 2), torch.arange(1, r, 2), torch.arange(r, head_dim)))


def permute_head_rows(rows: torch.Tensor, head_dim: int, rotary_dim: int | None = None) -> None:
    """Reorder, in place, the rows of each head of ``rows`` ([heads * head_dim, ...]: a q or k
    projection's weight or bias) by :func:`interleaved_to_half_order`."""
    order = interleaved_to_half_order(head_dim, rotary_dim).to(rows.device)
    view = rows.view(rows.shape[0] // head_dim, head_dim, *rows.shape[1:])
    view.copy_(view[:, order])


def permute_interleaved_qk(layers: Iterable[nn.Module], rotary_dim: int | None = None) -> None:
    """Reorder, in place, the q and k rows (weights and biases of each ``self_attn.qkv_proj``;
    this rank's heads under tensor parallelism) of every head of ``layers``, and the weights of
    their q/k norms when they have any (a multiple of head_dim: one row per head, or one shared
    by the heads), by :func:`interleaved_to_half_order`. Call after the weights are loaded,
    before packing or quantization; layers without ``self_attn`` (another pipeline stage's) are
    skipped."""
    with torch.no_grad():
        for layer in layers:
            attn = getattr(layer, "self_attn", None)
            if attn is None:
                continue
            qk_rows = attn.q_size + attn.kv_size
            for param in attn.qkv_proj.parameters(recurse=False):
                permute_head_rows(param[:qk_rows], attn.head_dim, rotary_dim)
            for norm in (attn.q_norm, attn.k_norm):
                if norm is not None:  # the norm runs before RoPE, on the permuted rows
                    permute_head_rows(norm.weight.view(-1), attn.head_dim, rotary_dim)
