"""MXFP4 weights (OCP Microscaling Formats v1.0, 2023), as GPT-OSS checkpoints store their MoE
experts: dequantized once at load time to the engine's dtype.

Format. A row of K weights is cut into K / 32 blocks of 32 consecutive values. Each block has
one shared scale, an E8M0 byte ``s`` (an exponent alone, bias 127: the scale is ``2^(s - 127)``),
and 32 FP4 E2M1 codes, two per byte, the lower nibble first (value ``2j`` of a byte's pair is its
bits 0-3, value ``2j + 1`` its bits 4-7). A 4-bit E2M1 code ``c`` is, by its bits
(sign, exponent 2 bits, mantissa 1 bit), one of::

    c      0    1    2    3    4    5    6    7
    value  0.0  0.5  1.0  1.5  2.0  3.0  4.0  6.0      (c + 8: the same, negative)

so a weight is ``FP4[c] * 2^(s - 127)``, exactly representable in float32 and bfloat16 (at most
two significant bits, exponents inside both formats' range for the scales checkpoints use).

Checkpoint tensors (GPT-OSS, ``model.layers.N.mlp.experts.``): ``<name>_blocks`` uint8
``[E, rows, K / 32, 16]`` and ``<name>_scales`` uint8 ``[E, rows, K / 32]``, for ``gate_up_proj``
(rows = 2I output rows, K = hidden) and ``down_proj`` (rows = hidden, K = I). The dequantized
``[E, rows, K]`` is transposed to ``[E, K, rows]``, the layout of the unquantized tensor of the
same name (transformers' ``GptOssExperts``), so a dequantized checkpoint is read exactly like an
unquantized one.
"""

from __future__ import annotations

import torch

#: The 16 FP4 E2M1 values by code (code & 8: negative).
FP4_E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_E2M1_VALUES += tuple(-v for v in FP4_E2M1_VALUES)
#: Values per MXFP4 block (one scale each), and bytes of codes per block.
MXFP4_BLOCK = 32
MXFP4_BLOCK_BYTES = MXFP4_BLOCK // 2
#: The suffixes of a checkpoint's MXFP4 pair; the pair stands for the tensor without them.
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
# Bytes of codes dequantized per chunk.
_CHUNK_BYTES = 1 << 23


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The weights of MXFP4 ``blocks`` / ``scales`` (module docstring), block by block.

    Args:
        blocks: uint8 ``[..., G, 16]``: G blocks of 32 FP4 codes, the lower nibble first.
        scales: uint8 ``[..., G]``: each block's E8M0 exponent (bias 127).
        dtype: the result's dtype (float32, bfloat16 or float16; exact in the first two).

    Returns:
        ``[..., G * 32]`` of ``dtype``: ``FP4[code] * 2^(scale - 127)``.

    Raises:
        ValueError: the dtypes are not uint8, the last dim of ``blocks`` is not 16, or the
            shapes do not agree (the message gives both shapes).
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.dim() < 2 or blocks.shape[-1] != MXFP4_BLOCK_BYTES or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
            f"(blocks [..., G, {MXFP4_BLOCK_BYTES}], scales [..., G])"
        )
    fp4 = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    byte = torch.arange(256)
    pairs = torch.stack([fp4[byte & 0x0F], fp4[byte >> 4]], dim=-1)  # byte -> (low, high)
    g = blocks.shape[-2]
    flat_blocks = blocks.reshape(-1, g, MXFP4_BLOCK_BYTES)
    flat_scales = scales.reshape(-1, g)
    out = torch.empty(flat_blocks.shape[0], g * MXFP4_BLOCK, dtype=dtype)
    # Rows in chunks: the int64 byte indices are 8 bytes per stored byte (a 120B layer's
    # experts hold about a gigabyte of codes).
    step = max(1, _CHUNK_BYTES // (g * MXFP4_BLOCK_BYTES))
    for lo in range(0, flat_blocks.shape[0], step):
        values = pairs[flat_blocks[lo : lo + step].long()].flatten(-2)  # [n, G, 32]
        exponents = flat_scales[lo : lo + step].to(torch.int32) - 127
        values = torch.ldexp(values, exponents.unsqueeze(-1))
        out[lo : lo + step] = values.flatten(-2)
    return out.view(*blocks.shape[:-2], g * MXFP4_BLOCK)


def dequantize_mxfp4_experts(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A GPT-OSS expert tensor from its MXFP4 pair: ``blocks`` uint8 ``[E, rows, K / 32, 16]``,
    ``scales`` uint8 ``[E, rows, K / 32]`` -> ``[E, K, rows]`` of ``dtype`` (contiguous), the
    layout of the unquantized checkpoint tensor.

    Raises:
        ValueError: as :func:`dequantize_mxfp4`, or when ``blocks`` is not 4-D.
    """
    if blocks.dim() != 4:
        raise ValueError(
            f"MXFP4 expert blocks must be [E, rows, K / 32, 16], got {tuple(blocks.shape)}"
        )
    return dequantize_mxfp4(blocks, scales, dtype).transpose(1, 2).contiguous()
