"""GGUF weights kept in their block-quantized form and multiplied natively (``quantization="gguf"``).

Instead of expanding every tensor to float32 at load (``gguf_loader``), the linear layers keep
llama.cpp's blocks, repacked once into one of two layouts that the C++ kernels
(``pagedllm/csrc/cpu/quant_gguf.cpp``) dequantize in registers:

* **q4** (4-bit affine, 32 weights per block): ``w = d * q + m``, ``q`` in 0..15; ``qs`` [N, K/2]
  uint8 in llama.cpp's Q4_1 nibble order, ``dm`` [N, K/32, 2] (d, m). Q4_1 is it already;
  Q4_0 (``w = d (q - 8)``) has ``m = -8 d``; Q4_K's eight 32-weight sub-blocks of a 256-weight
  super-block (``w = d sc q - dmin mn``, 6-bit ``sc`` and ``mn``) each become one block with
  ``d * sc`` and ``-dmin * mn``. All three are exact rewrites (llama.cpp ``ggml-quants.c``,
  ``dequantize_row_q4_0/q4_1/q4_K``).
* **q8** (signed 8-bit): ``w = d * q``; ``qs`` [N, K] int8 and either one scale per 32, ``d``
  [N, K/32] (Q8_0 and Q5_0, ``q - 16`` in -16..15), or one per 16, ``d`` [N, K/16] float32 (Q6_K:
  ``q - 32`` in -32..31 with an int8 scale per 16, times the super-block's ``d``).

Scales are float16 when every value of the matrix is exactly a float16 (Q4_0, Q4_1, Q8_0 and Q5_0
store float16 scales, so always for them), else float32: at batch 1 the weights stream from memory
once per token and the smaller scales cut the bytes per weight by about a sixth (q4: 20 bytes per
32 weights instead of 24, as llama.cpp's own blocks), with no change to any value.

For the kernels the rows are then interleaved in groups of 8 with the scales inline
(:func:`interleave`): one sequential stream per matrix, and every 32-bit SIMD lane one output
row, so the int-to-float conversion and the scaling are done once per block for 8 rows.

The activations are quantized per 32 to int8 inside the kernel (llama.cpp's Q8_0 activations), so
results differ from the float32 run by that rounding: the tests check kernels against
dequantize-then-float32 within a tolerance and the bundled model's teacher-forced argmaxes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from pagedllm.ops import CpuOps

# GGUF type name -> (bytes per block, weights per block).
BLOCK_BYTES: dict[str, tuple[int, int]] = {
    "Q4_0": (18, 32),
    "Q4_1": (20, 32),
    "Q4_K": (144, 256),
    "Q8_0": (34, 32),
    "Q5_0": (22, 32),
    "Q6_K": (210, 256),
}
#: GGUF type name -> bytes per 32 weights once repacked (quants, then scales: float16 where the
#: file's scale is one, float32 for Q4_K's and Q6_K's products; see the module docstring).
KERNEL_BYTES_PER_32: dict[str, int] = {
    "Q4_0": 16 + 4,
    "Q4_1": 16 + 4,
    "Q4_K": 16 + 8,
    "Q8_0": 32 + 2,
    "Q5_0": 32 + 2,
    "Q6_K": 32 + 8,
}
Q4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
Q8_TYPES = ("Q8_0", "Q5_0", "Q6_K")
SUPPORTED_TYPES = Q4_TYPES + Q8_TYPES


@dataclass
class PackedBlocks:
    """One weight matrix in a kernel layout (see the module docstring).

    Attributes:
        kind: "q4" or "q8".
        qs: [N, K/2] uint8 (q4) or [N, K] int8 (q8).
        scales: q4: [N, K/32, 2] (d, m), float16 or float32; q8: [N, K/32] float16 or
            [N, K/16] float32 (see the module docstring).
    """

    kind: str
    qs: torch.Tensor
    scales: torch.Tensor

    @property
    def rows(self) -> int:
        """Output rows N."""
        return int(self.qs.shape[0])

    def take_rows(self, index: torch.Tensor) -> PackedBlocks:
        """The rows ``index`` ([N] int64), in that order (the Q/K un-permutation)."""
        return PackedBlocks(self.kind, self.qs[index].contiguous(), self.scales[index].contiguous())

    def widened(self) -> PackedBlocks:
        """The same weights with float32 scales (q8: one per 16), the layout every matrix of its
        kind can take, so that parts of different scale layouts can be concatenated."""
        scales = self.scales.float()
        if self.kind == "q8" and self.scales.shape[1] * 32 == self.qs.shape[1]:  # one per 32
            scales = scales.repeat_interleave(2, dim=1)
        return PackedBlocks(self.kind, self.qs, scales.contiguous())

    @staticmethod
    def concat(parts: list[PackedBlocks]) -> PackedBlocks:
        """Row-wise concatenation of parts of one kind (q, k, v -> qkv); parts whose scale
        layouts differ are widened to float32 first (:meth:`widened`).

        Raises:
            ValueError: the parts are of different kinds (q4 and q8).
        """
        kind = parts[0].kind
        if any(p.kind != kind for p in parts):
            raise ValueError("cannot concatenate q4 and q8 blocks")
        if len({(p.scales.dtype, p.scales.shape[1:]) for p in parts}) > 1:
            parts = [p.widened() for p in parts]
        return PackedBlocks(
            kind, torch.cat([p.qs for p in parts]), torch.cat([p.scales for p in parts])
        )


def _blocks(data: np.ndarray, qtype: str, rows: int) -> np.ndarray:
    """Raw bytes as [rows * blocks per row, bytes per block] uint8."""
    nbytes, _ = BLOCK_BYTES[qtype]
    flat = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, -1)
    if flat.shape[1] % nbytes:
        raise ValueError(f"{qtype}: {flat.shape[1]} bytes per row is not a whole number of blocks")
    return flat.reshape(-1, nbytes)


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at byte ``offset`` of every block, as float32 [B]."""
    return blocks[:, offset : offset + 2].copy().view(np.float16)[:, 0].astype(np.float32)


def _compact_scales(scales: np.ndarray) -> torch.Tensor:
    """``scales`` as float16 when every value survives the round trip exactly, else float32."""
    f32 = np.ascontiguousarray(scales, dtype=np.float32)
    with np.errstate(over="ignore"):
        f16 = f32.astype(np.float16)
    if np.array_equal(f16.astype(np.float32), f32):
        return torch.from_numpy(f16)
    return torch.from_numpy(f32)


def _nibbles_to_q41(values: np.ndarray) -> np.ndarray:
    """[B, 32] values 0..15 -> [B, 16] bytes in Q4_1 order (byte j = v[j] | v[j + 16] << 4)."""
    v = values.astype(np.uint8)
    return v[:, :16] | (v[:, 16:] << 4)


def repack_q4(qtype: str, data: np.ndarray, rows: int) -> PackedBlocks:
    """Q4_0 / Q4_1 / Q4_K bytes of a [rows, K] matrix -> a q4 :class:`PackedBlocks`.

    Raises:
        ValueError: another type, or a row that is not whole blocks.
    """
    b = _blocks(data, qtype, rows)
    if qtype in ("Q4_0", "Q4_1"):
        d = _f16(b, 0)
        if qtype == "Q4_0":
            qs, m = b[:, 2:18], -8.0 * d
        else:
            qs, m = b[:, 4:20], _f16(b, 2)
        dm = np.stack([d, m], axis=-1)
    elif qtype == "Q4_K":
        d, dmin = _f16(b, 0), _f16(b, 2)
        s = b[:, 4:16].astype(np.uint8)
        sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], 1)
        mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], 1)
        raw = b[:, 16:144].reshape(-1, 4, 32)  # chunk c: sub-blocks 2c (low) and 2c+1 (high)
        sub = np.stack([raw & 0xF, raw >> 4], axis=2).reshape(-1, 32)  # [B * 8, 32] in order
        qs = _nibbles_to_q41(sub).reshape(-1, 16)
        dm = np.stack(
            [d[:, None] * sc.astype(np.float32), -(dmin[:, None] * mn.astype(np.float32))], -1
        ).reshape(-1, 2)
    else:
        raise ValueError(f"{qtype} is not a 4-bit type ({', '.join(Q4_TYPES)})")
    qs_t = torch.from_numpy(np.ascontiguousarray(qs)).reshape(rows, -1)
    return PackedBlocks("q4", qs_t, _compact_scales(dm).reshape(rows, -1, 2))


def repack_q8(qtype: str, data: np.ndarray, rows: int) -> PackedBlocks:
    """Q8_0 / Q5_0 / Q6_K bytes of a [rows, K] matrix -> a q8 :class:`PackedBlocks`.

    Raises:
        ValueError: another type, or a row that is not whole blocks.
    """
    b = _blocks(data, qtype, rows)
    if qtype == "Q8_0":
        d = _f16(b, 0)
        q = b[:, 2:34].view(np.int8)
        scales = d  # one per 32
    elif qtype == "Q5_0":
        d = _f16(b, 0)
        qh = b[:, 2:6].copy().view("<u4")[:, 0]
        high = ((qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
        lo = b[:, 6:22]
        low = np.concatenate([lo & 0xF, lo >> 4], axis=1)
        q = ((low | high).astype(np.int16) - 16).astype(np.int8)
        scales = d  # one per 32
    elif qtype == "Q6_K":
        ql, qh = b[:, 0:128], b[:, 128:192]
        sc = b[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(b, 208)
        halves = []
        for h in range(2):  # 128 weights each: ql[64h:64h+64], qh[32h:32h+32]
            l0, l1, hh = (
                ql[:, 64 * h : 64 * h + 32],
                ql[:, 64 * h + 32 : 64 * h + 64],
                qh[:, 32 * h : 32 * h + 32],
            )
            halves += [
                (l0 & 0xF) | ((hh & 3) << 4),
                (l1 & 0xF) | (((hh >> 2) & 3) << 4),
                (l0 >> 4) | (((hh >> 4) & 3) << 4),
                (l1 >> 4) | (((hh >> 6) & 3) << 4),
            ]
        q = (np.concatenate(halves, axis=1).astype(np.int16) - 32).astype(np.int8)
        scales = (d[:, None] * sc).reshape(-1)
    else:
        raise ValueError(f"{qtype} is not an 8-bit-layout type ({', '.join(Q8_TYPES)})")
    q_t = torch.from_numpy(np.ascontiguousarray(q)).reshape(rows, -1)
    p = PackedBlocks("q8", q_t, _compact_scales(scales).reshape(rows, -1))
    # The kernel reads float16 scales one per 32 and float32 ones one per 16.
    per32 = qtype != "Q6_K"
    return p if per32 == (p.scales.dtype == torch.float16) else p.widened()


def repack(qtype: str, data: np.ndarray, rows: int) -> PackedBlocks:
    """Any supported GGUF block type (``SUPPORTED_TYPES``) -> its kernel layout.

    Raises:
        ValueError: naming the type when it is not supported.
    """
    if qtype in Q4_TYPES:
        return repack_q4(qtype, data, rows)
    if qtype in Q8_TYPES:
        return repack_q8(qtype, data, rows)
    raise ValueError(f"GGUF type {qtype} has no native kernel ({', '.join(SUPPORTED_TYPES)})")


def dequantize_packed(p: PackedBlocks) -> torch.Tensor:
    """The float32 [N, K] matrix a :class:`PackedBlocks` holds (tests and reference;
    :class:`GGUFEmbedding`'s looked-up rows)."""
    k = p.qs.shape[1] * (2 if p.kind == "q4" else 1)  # explicit sizes: rows may be 0
    if p.kind == "q4":
        qs = p.qs.reshape(p.rows, k // 32, 16)
        q = torch.stack([qs & 0xF, qs >> 4], dim=-2).reshape(p.rows, k // 32, 32).float()
        dm = p.scales.float()
        w = q * dm[..., :1] + dm[..., 1:]
        return w.reshape(p.rows, k)
    per = k // p.scales.shape[1]  # 32 or 16 weights per scale
    w = p.qs.float().reshape(p.rows, k // per, per).mul_(p.scales.float()[..., None])
    return w.reshape(p.rows, k)


#: Output rows interleaved per record of the kernel layout (``csrc/cpu/quant_gguf.h``) that runs
#: on every CPU; ``CpuOps.gguf_group_rows`` is 16 where the 512-bit loops run.
GROUP_ROWS = 8


def interleave(p: PackedBlocks, group_rows: int = GROUP_ROWS) -> torch.Tensor:
    """``p`` in the kernels' row-interleaved layout: [ceil(N / G), K / 32, bytes] uint8 with G =
    ``group_rows`` (8, or 16 for the 512-bit loops), one record per (group of G rows, block of
    32) holding the G rows' quants and then their scales, so that a GEMV reads one stream and
    each 32-bit SIMD lane is one output row (``csrc/cpu/quant_gguf.h`` gives the byte order).
    Padding rows (N not a multiple of G) are zero and their outputs dropped by the kernel.

    For G = 8, q4: 128 bytes of quants (chunk c, row r: the row's bytes 4c..4c+3 of the block),
    then d[8] and m[8] (float16: 160 bytes, float32: 192). q8: 256 bytes (chunk g, row r:
    elements 4g..4g+3), then d[8] float16 (one per 32: 272 bytes) or d0[8], d1[8] float32 (one
    per 16: 320 bytes). G = 16 doubles every chunk and scale array.

    Raises:
        ValueError: ``group_rows`` is neither 8 nor 16.
    """
    if group_rows not in (8, 16):
        raise ValueError(f"group_rows must be 8 or 16, got {group_rows}")
    pad = -p.rows % group_rows
    qs, scales = p.qs, p.scales
    if pad:
        qs = torch.cat([qs, qs.new_zeros(pad, *qs.shape[1:])])
        scales = torch.cat([scales, scales.new_zeros(pad, *scales.shape[1:])])
    groups = qs.shape[0] // group_rows
    chunk = 4 if p.kind == "q4" else 8  # 4-byte chunks per row and block
    nb = qs.shape[1] // (4 * chunk)
    quants = (
        qs.view(torch.uint8)
        .reshape(groups, group_rows, nb, chunk, 4)
        .permute(0, 2, 3, 1, 4)
        .reshape(groups, nb, -1)
    )
    per_block = scales.numel() // (p.rows + pad) // nb  # q4: (d, m); q8: 1 or 2 scales
    s = scales.reshape(groups, group_rows, nb, per_block).permute(0, 2, 3, 1).contiguous()
    s_bytes = s.view(torch.uint8).reshape(groups, nb, -1)
    return torch.cat([quants, s_bytes], dim=-1).contiguous()


@dataclass
class KernelWeight:
    """One part of a :class:`GGUFLinear` as the kernel reads it.

    Attributes:
        kind: "q4" or "q8".
        rows: output rows N.
        data: :func:`interleave`'s [ceil(N / G), K / 32, bytes] uint8, G =
            ``CpuOps.gguf_group_rows``.
    """

    kind: str
    rows: int
    data: torch.Tensor


class GGUFLinear(nn.Module):
    """y = x W^T (+ b) with W kept in GGUF blocks (:class:`PackedBlocks`, interleaved once for
    the kernels by :func:`interleave`).

    Args:
        parts: the row blocks of W in output order (one, or q/k/v of different types); adjacent
            parts of one kind are merged so that one kernel call covers them.
        cpu_ops: the C++ CPU kernels (``gguf_q4_linear`` / ``gguf_q8_linear``).
        bias: [N] float32 or None.

    Forward: x [..., K] float32 -> [..., N] float32.
    """

    def __init__(
        self, parts: list[PackedBlocks], cpu_ops: CpuOps, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        merged: list[PackedBlocks] = []
        for p in parts:
            if merged and merged[-1].kind == p.kind:
                merged[-1] = PackedBlocks.concat([merged[-1], p])
            else:
                merged.append(p)
        rows = cpu_ops.gguf_group_rows
        self.parts = [KernelWeight(p.kind, p.rows, interleave(p, rows)) for p in merged]
        self.ops = cpu_ops
        self.out_features = sum(p.rows for p in merged)
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def _run(self, p: KernelWeight, x: torch.Tensor) -> torch.Tensor:
        if p.kind == "q4":
            return self.ops.gguf_q4_linear(x, p.data, p.rows)
        return self.ops.gguf_q8_linear(x, p.data, p.rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.stride(-1) == 1 and len(self.parts) == 1 and self.bias is None:
            return self._run(self.parts[0], x)  # the decode path: one kernel call, no reshapes
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        if len(self.parts) == 1:
            y = self._run(self.parts[0], flat)
        else:
            y = torch.cat([self._run(p, flat) for p in self.parts], dim=1)
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*lead, self.out_features)

    def weight_bytes(self) -> int:
        """Bytes held by the quantized weight (quants, scales and the padding rows)."""
        return sum(p.data.numel() for p in self.parts)

    def extra_repr(self) -> str:
        kinds = "+".join(p.kind for p in self.parts)
        return f"out_features={self.out_features}, {kinds}, gguf native"


class GGUFEmbedding(nn.Module):
    """A token embedding kept in GGUF blocks (``quantization="gguf"``): the looked-up rows are
    dequantized on the fly instead of the whole [V, d] table being expanded to float32 at load.
    The rows equal the float32 expansion bit for bit (:func:`dequantize_packed` is exact: every
    product of a block scale and a quant fits float32's mantissa, and a q4 offset is added once,
    as ``gguf.quants`` does).

    Args:
        table: the embedding matrix [V, d] (:class:`PackedBlocks`, not interleaved).

    Forward: ids (any shape) int64 -> [*ids.shape, d] float32.

    Raises:
        IndexError: an id outside [0, V) (as ``nn.Embedding``).
    """

    def __init__(self, table: PackedBlocks) -> None:
        super().__init__()
        self.kind = table.kind
        self.qs: torch.Tensor
        self.scales: torch.Tensor
        self.register_buffer("qs", table.qs, persistent=False)
        self.register_buffer("scales", table.scales, persistent=False)
        self.num_embeddings = table.rows
        self.embedding_dim = int(table.qs.shape[1]) * (2 if table.kind == "q4" else 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < self.num_embeddings:
            raise IndexError(f"token ids must be in [0, {self.num_embeddings})")
        rows = PackedBlocks(self.kind, self.qs[flat], self.scales[flat])
        return dequantize_packed(rows).view(*ids.shape, self.embedding_dim)

    def weight_bytes(self) -> int:
        """Bytes held by the quantized table (quants and scales)."""
        return self.qs.numel() * self.qs.element_size() + (
            self.scales.numel() * self.scales.element_size()
        )

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind}, gguf blocks"
