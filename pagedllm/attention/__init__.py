"""Attention backends behind one interface, chosen by name from a small registry.

A backend has ``forward(query, key, value, key_cache, value_cache, meta, scale) -> out``: it writes
the new tokens' K/V into their slots, then attends over each sequence's paged context.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pagedllm.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


def get_attention_backend(name: str = "auto") -> AttentionBackend:
    """Return a backend instance: "reference", "torch_native", or "auto" (best available).

    Raises:
        ValueError: naming ``attention_backend`` for an unknown name.
    """
    if name in ("auto", "torch_native"):
        from pagedllm.attention.torch_native import TorchNativeAttention

        return TorchNativeAttention()
    if name == "reference":
        from pagedllm.attention.reference import ReferenceAttention

        return ReferenceAttention()
    raise ValueError(f"attention_backend must be auto, torch_native or reference, got {name!r}")


__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
