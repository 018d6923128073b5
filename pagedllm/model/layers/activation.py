"""Gated MLP activations: act(gate) * up over a fused [T, 2I] gate/up product.

SwiGLU (SiLU gate, Shazeer 2020 "GLU Variants Improve Transformer") for Llama, Qwen and Mistral;
GeGLU with the tanh approximation of GELU (Hendrycks & Gimpel 2016) for Gemma; GPT-OSS's
clamped SwiGLU (:func:`clamped_swiglu`) for its experts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from pagedllm.ops import CpuOps


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# Hugging Face ``hidden_act`` / ``hidden_activation`` names -> elementwise function.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,  # GPT-2's name for the tanh approximation
    "gelu": F.gelu,
    "relu": F.relu,
}


def activation_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The elementwise activation called ``name`` (Hugging Face spelling).

    Raises:
        ValueError: naming ``hidden_act`` and listing the supported names.
    """
    fn = ACTIVATIONS.get(name)
    if fn is None:
        raise ValueError(f"hidden_act {name!r} is not supported ({', '.join(ACTIVATIONS)})")
    return fn


def gated_activation(
    gate_up: torch.Tensor, inter: int, name: str, cpu_ops: CpuOps | None = None
) -> torch.Tensor:
    """act(gate) * up for ``gate_up`` [T, 2I] (gate columns first); returns [T, I].

    SiLU runs on the fused C++ kernel when ``cpu_ops`` is given and the tensor is 2-D; the other
    activations (and SiLU without the kernel) on ATen.
    """
    if cpu_ops is not None and name in ("silu", "swish") and gate_up.dim() == 2:
        act = gate_up.new_empty(gate_up.shape[0], inter)
        cpu_ops.silu_and_mul(act, gate_up)
        return act
    gate, up = gate_up.split(inter, dim=-1)
    return activation_fn(name)(gate) * up


def clamped_swiglu(gate_up: torch.Tensor, inter: int, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's expert activation (OpenAI 2025, gpt-oss model card, section 2.1): with
    ``g = clamp(gate, max=limit)`` and ``u = clamp(up, -limit, limit)``,
    ``(u + 1) * g * sigmoid(alpha * g)``, in that order of operations (transformers').

    Args:
        gate_up: [T, 2I], the gate columns first, then the up columns (a checkpoint's
            interleaved gate / up columns are separated at load time).
        inter: I.
        alpha: the sigmoid's gain (1.702).
        limit: the clamp (``swiglu_limit``, 7.0).

    Returns:
        [T, I], gate_up's dtype.
    """
    gate, up = gate_up.split(inter, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
