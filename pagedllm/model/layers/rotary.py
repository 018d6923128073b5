"""Rotary position embeddings (Su et al. 2021, RoFormer) in the "rotate half" layout of Hugging
Face checkpoints: default, linear and Llama 3 frequency scaling, partial rotary (only the first
``rotary_dim`` dimensions of a head turn) and one table per base (Gemma 3's local and global
layers use different bases)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from pagedllm.ops import CpuOps

Rotate = Callable[[torch.Tensor], torch.Tensor]


def rope_inv_freq(
    rotary_dim: int, theta: float, scaling: dict[str, Any] | None = None
) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] float32, with RoPE scaling applied.

    Base: theta^(-2i / rotary_dim) (RoFormer eq. 15). Scaling: "linear" divides every frequency
    by ``factor``; "llama3" (Llama 3.1) keeps high frequencies, divides low ones by ``factor``
    and interpolates smoothly between ``low_freq_factor`` and ``high_freq_factor``.

    Raises:
        ValueError: naming ``rope_scaling`` for an unsupported type.
    """
    d = rotary_dim
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if scaling is None or kind == "default":
        return inv
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, D] by the step's angles (``RotaryEmbedding.lookup``); same shape."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RotaryEmbedding(nn.Module):
    """A cos/sin table for every position up to ``max_positions``.

    Args:
        rotary_dim: dimensions of each head that rotate (the head size, or less for partial
            rotary: the rest pass through unchanged); even.
        theta: the base.
        scaling: Hugging Face ``rope_scaling`` dict or None.
        max_positions: table length (the engine's max_model_len).
    """

    def __init__(
        self,
        rotary_dim: int,
        theta: float,
        scaling: dict[str, Any] | None,
        max_positions: int,
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        inv = rope_inv_freq(rotary_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)  # [P, R/2]
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.cpu_ops: CpuOps | None = None  # the C++ kernels when fused ops are on (fp32, CPU)

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for a step's positions, [T, 1, R/2] each; computed once per step."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(
            dtype
        )

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotate:
        """The step's rotation: a function taking [T, heads, D] (a strided view is fine) and
        returning it rotated by ``positions`` ([T] int64). With the C++ kernel (fp32 on the CPU)
        it rotates in place with no temporaries; otherwise it returns a new tensor. With partial
        rotary only ``x[..., :rotary_dim]`` turns."""
        ops = self.cpu_ops
        r = self.rotary_dim
        if ops is not None and dtype == torch.float32 and positions.device.type == "cpu":
            cos, sin = self.cos, self.sin
            positions = positions.contiguous()

            def rotate_in_place(x: torch.Tensor) -> torch.Tensor:
                ops.rotary_embedding(x if x.shape[-1] == r else x[..., :r], positions, cos, sin)
                return x

            return rotate_in_place
        cos_t, sin_t = self.lookup(positions, dtype)  # gathered once per step, not per layer

        def rotate(x: torch.Tensor) -> torch.Tensor:
            if x.shape[-1] == r:
                return apply_rotary(x, cos_t, sin_t)
            return torch.cat((apply_rotary(x[..., :r], cos_t, sin_t), x[..., r:]), dim=-1)

        return rotate
