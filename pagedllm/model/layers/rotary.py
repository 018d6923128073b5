"""Rotary position embeddings (Su et al. 2021, RoFormer) in the "rotate half" layout of Hugging
Face checkpoints: every frequency scaling of ``layers.rope_scaling`` (default, linear, llama3,
YaRN, dynamic NTK, Phi-3 LongRoPE), partial rotary (only the first
``rotary_dim`` dimensions of a head turn) and one table per base (Gemma 3's local and global
layers use different bases)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedllm.model.layers.rope_scaling import (
    LENGTH_DEPENDENT_TYPES,
    base_inv_freq,
    dynamic_ntk_inv_freq,
    frequency_length,
    longrope_inv_freqs,
    rope_type,
    static_inv_freq,
)

if TYPE_CHECKING:
    from pagedllm.attention.metadata import AttentionMetadata
    from pagedllm.ops import CpuOps

Rotate = Callable[[torch.Tensor], torch.Tensor]

# Activation dtypes the C++ rotary kernel rotates in place.
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def rope_inv_freq(
    rotary_dim: int, theta: float, scaling: dict[str, Any] | None = None, trained_len: int = 2048
) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] float32 of a static scaling type ("default",
    "linear", "llama3", "yarn"; see ``layers.rope_scaling``).

    Raises:
        ValueError: naming ``rope_scaling`` for an unsupported or length-dependent type.
    """
    return static_inv_freq(rotary_dim, theta, scaling, trained_len)[0]


def tokens_frequency_lengths(meta: AttentionMetadata, positions: torch.Tensor) -> torch.Tensor:
    """[T] int64: for each new token of the step (at ``positions``, [T] int64), the sequence
    length whose frequencies it uses: ``rope_scaling.frequency_length`` of its sequence's prompt
    length (``meta.prompt_lens_list``); without prompt lengths, its sequence's length after the
    step.

    Raises:
        ValueError: ``positions`` differs in length from the tokens ``meta`` describes.
    """
    dev = meta.seq_lens.device
    prompts = meta.prompt_lens_list
    per_seq = meta.seq_lens if prompts is None else torch.tensor(prompts, device=dev)
    lens = torch.repeat_interleave(per_seq, torch.tensor(meta.query_lens_list, device=dev))
    if lens.shape[0] != positions.shape[0]:
        raise ValueError(f"positions has {positions.shape[0]} entries, the metadata {lens.shape[0]}")
    return lens if prompts is None else frequency_length(positions, lens)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, D] by the step's angles (``RotaryEmbedding.lookup``); same shape."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RotaryEmbedding(nn.Module):
    """A cos/sin table for every position up to ``max_positions``.

    Static scaling types have one table. "longrope" stacks the short-factor table over the
    long-factor one ([2P, R/2]) and picks the row per token from its sequence's length, so the C++
    kernel still just gathers table rows. "dynamic" (NTK) keeps the unscaled table for sequences
    within the trained context and computes the angles of the step's tokens in longer ones from
    their sequence's length. Both follow transformers' cached generation: a prompt token uses
    the frequencies of the prompt's length, an output token those of its position + 1 (cached
    keys are not rotated again), whatever the schedule (``tokens_frequency_lengths``).

    Args:
        rotary_dim: dimensions of each head that rotate (the head size, or less for partial
            rotary: the rest pass through unchanged); even.
        theta: the base.
        scaling: Hugging Face ``rope_scaling`` dict or None (``layers.rope_scaling``).
        max_positions: table length (the engine's max_model_len).
        trained_len: the checkpoint's ``max_position_embeddings`` (dynamic NTK's threshold,
            YaRN's and LongRoPE's defaults).

    Raises:
        ValueError: naming ``rope_scaling`` for an unsupported type or bad factors.
    """

    def __init__(
        self,
        rotary_dim: int,
        theta: float,
        scaling: dict[str, Any] | None,
        max_positions: int,
        trained_len: int = 2048,
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.kind = rope_type(scaling)
        self.theta = theta
        self.trained_len = trained_len
        self.num_positions = max_positions
        self.switch_len = 0  # longrope: longer sequences use the long factors
        self.ntk_factor = 1.0  # dynamic: the NTK factor
        pos = torch.arange(max_positions, dtype=torch.float32)
        if self.kind == "longrope" and scaling is not None:
            short, long, mult, self.switch_len = longrope_inv_freqs(
                rotary_dim, theta, scaling, trained_len
            )
            freqs = torch.cat((torch.outer(pos, short), torch.outer(pos, long)))  # [2P, R/2]
        elif self.kind == "dynamic" and scaling is not None:
            self.ntk_factor = float(scaling["factor"])
            freqs, mult = torch.outer(pos, base_inv_freq(rotary_dim, theta)), 1.0
        else:
            inv, mult = static_inv_freq(rotary_dim, theta, scaling, trained_len)
            freqs = torch.outer(pos, inv)  # [P, R/2]
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", freqs.cos() * mult, persistent=False)
        self.register_buffer("sin", freqs.sin() * mult, persistent=False)
        self.cpu_ops: CpuOps | None = None  # the C++ kernels when fused ops are on (fp32 / bf16, CPU)

    def step_tables(
        self, positions: torch.Tensor, meta: AttentionMetadata | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cos [N, R/2], sin [N, R/2], rows [T] int64): the tables the step reads and each
        token's row in them; the positions themselves for static types (or without ``meta``)."""
        if meta is None or self.kind not in LENGTH_DEPENDENT_TYPES:
            return self.cos, self.sin, positions
        if self.kind == "longrope":
            is_long = tokens_frequency_lengths(meta, positions) > self.switch_len
            return self.cos, self.sin, positions + is_long * self.num_positions
        longest = max(meta.seq_lens_list + (meta.prompt_lens_list or []), default=0)
        if longest <= self.trained_len:
            return self.cos, self.sin, positions  # dynamic NTK within the trained context
        lens = tokens_frequency_lengths(meta, positions)
        inv = dynamic_ntk_inv_freq(
            self.rotary_dim, self.theta, self.ntk_factor, self.trained_len, lens
        )
        freqs = positions.float()[:, None] * inv  # [T, R/2]
        rows = torch.arange(positions.shape[0], device=positions.device)
        return freqs.cos(), freqs.sin(), rows

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype, meta: AttentionMetadata | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for a step's positions, [T, 1, R/2] each; computed once per step."""
        cos, sin, rows = self.step_tables(positions, meta)
        return cos[rows].unsqueeze(1).to(dtype), sin[rows].unsqueeze(1).to(dtype)

    def for_step(
        self, positions: torch.Tensor, dtype: torch.dtype, meta: AttentionMetadata | None = None
    ) -> Rotate:
        """The step's rotation: a function taking [T, heads, D] (a strided view is fine) and
        returning it rotated by ``positions`` ([T] int64; ``meta`` gives the sequence lengths
        the length-dependent types need). With the C++ kernel (fp32 / bf16 on the CPU, in fp32
        arithmetic with the fp32 tables) it rotates in
        place with no temporaries; otherwise it returns a new tensor. With partial rotary only
        ``x[..., :rotary_dim]`` turns."""
        ops = self.cpu_ops
        r = self.rotary_dim
        if ops is not None and dtype in _KERNEL_DTYPES and positions.device.type == "cpu":
            cos, sin, rows = self.step_tables(positions, meta)
            rows = rows.contiguous()

            def rotate_in_place(x: torch.Tensor) -> torch.Tensor:
                ops.rotary_embedding(x if x.shape[-1] == r else x[..., :r], rows, cos, sin)
                return x

            return rotate_in_place
        cos_t, sin_t = self.lookup(positions, dtype, meta)  # gathered once per step, not per layer

        def rotate(x: torch.Tensor) -> torch.Tensor:
            if x.shape[-1] == r:
                return apply_rotary(x, cos_t, sin_t)
            return torch.cat((apply_rotary(x[..., :r], cos_t, sin_t), x[..., r:]), dim=-1)

        return rotate
