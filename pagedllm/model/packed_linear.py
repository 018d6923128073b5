"""Linear layers with weights prepacked for oneDNN, for fp32 on the CPU.

``F.linear`` on the CPU calls MKL's sgemm, which re-reads the weight in its row-major layout on
every call. oneDNN (bundled in PyTorch as MKL-DNN) can reorder the weight once into its blocked
layout and then run the matmul from it; PyTorch exposes this pair as
``mkldnn::_reorder_linear_weight`` and ``mkldnn::_linear_pointwise`` (what Inductor's weight
freezing uses). Measured on this 2-core AMD EPYC (AVX2), fp32, the step's linear layers at batch
64: 0.28-0.30 s of CPU time with packed weights vs 0.30-0.45 s with MKL (``benchmarks/
decode_step.py`` compares them end to end); the largest gains are on the gate/up projection and
the LM head (576 x 3072 and 576 x 49152).

The weights are packed once at load time; the original parameters are dropped, so memory does not
grow (the LM head, tied to the embedding, gets its own packed copy). Disable with
``PAGEDLLM_DISABLE_PACKED_LINEAR=1`` (falls back to ``F.linear``).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

logger = logging.getLogger(__name__)


def packed_linear_available(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether packed oneDNN linears can run: CPU, float32, PyTorch built with MKL-DNN, the ops
    present, and not disabled by ``PAGEDLLM_DISABLE_PACKED_LINEAR=1``."""
    if os.environ.get("PAGEDLLM_DISABLE_PACKED_LINEAR") == "1":
        return False
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


class PackedLinear(nn.Module):
    """y = x W^T (no bias) from a weight prepacked once into oneDNN's layout.

    Args:
        weight: [out_features, in_features] float32 CPU tensor (copied into the packed layout;
            the caller may drop it afterwards).

    Forward: x [T, in_features] float32 -> [T, out_features] float32.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            # batch_size None: one layout for every number of rows (decode and prefill steps).
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN packed"


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every bias-free ``nn.Linear`` in ``model`` (exact type, not subclasses, which may
    add communication) by a :class:`PackedLinear` holding the same weight. Returns the count."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.bias is None:
                setattr(parent, name, PackedLinear(child.weight))
                count += 1
    return count
