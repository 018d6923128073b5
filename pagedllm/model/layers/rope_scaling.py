"""RoPE frequency scaling: the inverse frequencies (and the cos/sin multiplier) of every
``rope_scaling`` type a Hugging Face checkpoint may name.

Static types give one table for all positions: "default", "linear" (position interpolation, Chen
et al. 2023), "llama3" (Llama 3.1's smooth low-frequency scaling) and "yarn" (Peng et al. 2023,
"YaRN", section 3.2 eq. 17-19 for the ramp between interpolated and extrapolated frequencies,
section 3.4 for the attention temperature ``0.1 ln(s) + 1`` applied to cos and sin).

Two types depend on the length of the sequence a token belongs to, as transformers computes them:
"dynamic" (dynamic NTK scaling, bloc97 2023: the base grows with the sequence once it is longer
than the trained context) and "longrope" (Phi-3, Ding et al. 2024 "LongRoPE": per-frequency
rescale factors, the short set up to ``original_max_position_embeddings``, the long set beyond,
and the attention factor ``sqrt(1 + ln(s) / ln(original))`` on cos and sin).

Transformers' cached generation computes the prompt in one forward pass, where every prompt token
sees the prompt's length, and each output token in a pass of its own, where it sees its position
+ 1. :func:`frequency_length` gives every token that same length under any schedule (chunked
prefill, recompute after preemption, speculative verification), and
:func:`prompt_frequency_key` tells prefix caching which prompts computed their blocks alike.
"""

from __future__ import annotations

import math
from typing import Any

import torch

STATIC_TYPES = ("default", "linear", "llama3", "yarn")
LENGTH_DEPENDENT_TYPES = ("dynamic", "longrope")


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The scaling type of a ``rope_scaling`` dict ("default" for None); ``type`` is the
    transformers 4 spelling of ``rope_type``."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def base_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """theta^(-2i / rotary_dim) for i < rotary_dim / 2 (RoFormer eq. 15): [rotary_dim / 2]
    float32."""
    d = rotary_dim
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))


def _llama3(inv: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_mid, mid, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(
    rotary_dim: int, theta: float, scaling: dict[str, Any], trained_len: int
) -> tuple[torch.Tensor, float]:
    d = rotary_dim
    original = longrope_switch_len(scaling, trained_len)
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else trained_len / original
    attn = scaling.get("attention_factor")
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attn is None:
        if mscale and mscale_all:
            attn = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attn = _yarn_mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:  # the dimension that turns ``rotations`` times
        return (d * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, d, 2).float() / d)
    extrapolate = 1 - ramp  # 1: keep the frequency (high frequencies), 0: interpolate it
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attn)


def static_inv_freq(
    rotary_dim: int, theta: float, scaling: dict[str, Any] | None, trained_len: int = 2048
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2] float32, cos/sin multiplier) of a static type.

    Args:
        rotary_dim: dimensions of a head that rotate (even).
        theta: the RoPE base.
        scaling: ``rope_scaling`` dict or None.
        trained_len: the checkpoint's ``max_position_embeddings`` (YaRN's defaults).

    Raises:
        ValueError: naming ``rope_scaling`` when the type is not static or unknown.
    """
    kind = rope_type(scaling)
    inv = base_inv_freq(rotary_dim, theta)
    if kind == "default" or scaling is None:
        return inv, 1.0
    if kind == "linear":
        return inv / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv, scaling), 1.0
    if kind == "yarn":
        return _yarn(rotary_dim, theta, scaling, trained_len)
    if kind in LENGTH_DEPENDENT_TYPES:
        raise ValueError(
            f"rope_scaling type {kind!r} depends on the sequence length: use RotaryEmbedding"
        )
    known = ", ".join(STATIC_TYPES + LENGTH_DEPENDENT_TYPES)
    raise ValueError(f"rope_scaling type {kind!r} is not supported ({known})")


def frequency_length(positions: torch.Tensor, prompt_lens: torch.Tensor) -> torch.Tensor:
    """[T] int64: the sequence length whose frequencies the token at each of ``positions`` ([T]
    int64) uses, ``max(prompt_len, position + 1)``: the prompt's length for a prompt token, its
    own position + 1 for an output token (``prompt_lens``: [T] int64, the prompt length of each
    token's sequence). Independent of how the tokens are split into steps."""
    return torch.maximum(positions + 1, prompt_lens)


def longrope_switch_len(scaling: dict[str, Any], trained_len: int) -> int:
    """LongRoPE: sequences longer than this many tokens use the long factors."""
    return int(scaling.get("original_max_position_embeddings") or trained_len)


def prompt_frequency_key(
    scaling: dict[str, Any] | None, trained_len: int, num_prompt_tokens: int
) -> str | None:
    """What a prompt's KV blocks depend on beyond its tokens, for prefix caching: None where
    they do not (static types, and prompts within the length-dependent types' unscaled range),
    else a key that equals another prompt's exactly when both rotate their prompt tokens with
    the same frequencies ("longrope-long" beyond the switch; "dynamic-L" for an L-token prompt
    beyond the trained context). Output tokens use their own position (:func:`frequency_length`),
    so a cached block holding them matches every prompt with the same key."""
    kind = rope_type(scaling)
    if scaling is None or kind not in LENGTH_DEPENDENT_TYPES:
        return None
    if kind == "longrope":
        long = num_prompt_tokens > longrope_switch_len(scaling, trained_len)
        return "longrope-long" if long else None
    return f"dynamic-{num_prompt_tokens}" if num_prompt_tokens > trained_len else None


def longrope_inv_freqs(
    rotary_dim: int, theta: float, scaling: dict[str, Any], trained_len: int
) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """Phi-3 LongRoPE: (short inv freq, long inv freq, cos/sin multiplier, switch length).

    A sequence of at most ``original_max_position_embeddings`` tokens uses the short factors,
    a longer one the long factors (both [rotary_dim / 2] float32 ``1 / (factor_i * base_i)``).

    Raises:
        ValueError: naming ``rope_scaling`` when a factor list is missing or has the wrong length.
    """
    original = longrope_switch_len(scaling, trained_len)
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else trained_len / original
    attn = scaling.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    base = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
    out = []
    for key in ("short_factor", "long_factor"):
        f = scaling.get(key)
        if f is None or len(f) != rotary_dim // 2:
            raise ValueError(
                f"rope_scaling {key} must list {rotary_dim // 2} factors (longrope), got {f!r}"
            )
        out.append(1.0 / (torch.tensor(f, dtype=torch.float32) * base))
    return out[0], out[1], float(attn), original


def dynamic_ntk_inv_freq(
    rotary_dim: int, theta: float, factor: float, trained_len: int, seq_lens: torch.Tensor
) -> torch.Tensor:
    """Dynamic NTK inverse frequencies per token: [T, rotary_dim / 2] float32.

    The base of a token whose sequence holds ``L`` tokens is
    ``theta * (factor * L / trained_len - (factor - 1)) ** (d / (d - 2))`` with
    ``L = max(L, trained_len)`` (so sequences within the trained context keep the plain base).

    Args:
        seq_lens: [T] int64, the length of each token's sequence (cached + this step's tokens).
    """
    d = rotary_dim
    length = seq_lens.clamp(min=trained_len).float()
    base = theta * ((factor * length / trained_len) - (factor - 1)) ** (d / (d - 2))
    exponent = torch.arange(0, d, 2, dtype=torch.int64, device=seq_lens.device).float() / d
    return 1.0 / (base[:, None] ** exponent[None, :])
