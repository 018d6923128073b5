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


def get_attention_backend(
    name: str = "auto", device: torch.device | str | None = None
) -> AttentionBackend:
    """Return a backend instance by name.

    Names: "reference" (the oracle), "torch_native" (vectorized torch), "cpu" (C++ kernels,
    built on first use; falls back to torch_native with a warning if they cannot be built),
    "triton" (Triton kernels, CUDA), or "auto": "triton" when ``device`` is a CUDA device and
    Triton works there, else "cpu" when the C++ kernels build, else "torch_native".

    Raises:
        ValueError: naming ``attention_backend`` for an unknown name.
    """
    if name == "auto":
        if device is not None and torch.device(device).type == "cuda":
            from pagedllm.attention.triton_paged import TritonPagedAttention, triton_available

            if triton_available():
                return TritonPagedAttention()
            name = "torch_native"
        else:
            from pagedllm.attention.cpu import CpuPagedAttention, cpu_ops_available

            if cpu_ops_available():
                return CpuPagedAttention()
            name = "torch_native"
    if name == "torch_native":
        from pagedllm.attention.torch_native import TorchNativeAttention

        return TorchNativeAttention()
    if name == "cpu":
        from pagedllm.attention.cpu import CpuPagedAttention

        return CpuPagedAttention()
    if name == "triton":
        from pagedllm.attention.triton_paged import TritonPagedAttention

        return TritonPagedAttention()
    if name == "reference":
        from pagedllm.attention.reference import ReferenceAttention

        return ReferenceAttention()
    raise ValueError(
        f"attention_backend must be auto, cpu, triton, torch_native or reference, got {name!r}"
    )


__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
