"""Typed Python face of the C++ CPU kernels registered as ``torch.ops.pagedllm.<name>``.

Each method calls the op's default overload (``torch.ops.pagedllm.<name>.default``, resolved
once here) with the same arguments; the C++ side checks shapes, dtypes and devices and raises
``RuntimeError`` on a mismatch. Ops that write in place return ``None``. Build and load:
:mod:`pagedllm.ops.loader`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class CpuOps:
    """The loaded kernels of one ISA variant (``avx512``, ``avx2`` or ``scalar``).

    Tensors are CPU tensors. The attention ops take float32 or bfloat16; the layer ops and the
    GEMM float32 only. Layouts: ``query``/``out`` ``[T, H, D]``, KV caches
    ``[KVH, num_blocks, block_size, D]``, block tables ``[S, max_blocks]`` int64.
    """

    def __init__(self, variant: str) -> None:
        lib = torch.ops.pagedllm  # raises AttributeError when the library is not loaded
        self.variant = variant
        self._decode = lib.paged_attention_decode.default
        self._prefill = lib.paged_attention_prefill.default
        self._reshape_and_cache = lib.reshape_and_cache.default
        self._copy_blocks = lib.copy_blocks.default
        self._swap_blocks = lib.swap_blocks.default
        self._simd_level = lib.simd_level.default
        self._rms_norm = lib.rms_norm.default
        self._fused_add_rms_norm = lib.fused_add_rms_norm.default
        self._silu_and_mul = lib.silu_and_mul.default
        self._rotary_embedding = lib.rotary_embedding.default
        self._gemm_pack_weight = lib.gemm_pack_weight.default
        self._gemm_pack_swiglu_weight = lib.gemm_pack_swiglu_weight.default
        self._gemm_linear = lib.gemm_linear.default
        self._gemm_linear_add_ = lib.gemm_linear_add_.default
        self._gemm_swiglu = lib.gemm_swiglu.default
        self._gemm_bf16 = bool(lib.gemm_bf16_supported.default())
        self._argmax_logsumexp = lib.argmax_logsumexp.default
        self._gguf_q4_linear = lib.gguf_q4_linear.default
        self._gguf_q8_linear = lib.gguf_q8_linear.default
        self._gguf_group_rows = int(lib.gguf_group_rows.default())
        self._gguf_isa = str(lib.gguf_isa.default())
        self._int8_pack_weight = lib.int8_pack_weight.default
        self._int8_quantize_rows = lib.int8_quantize_rows.default
        self._int8_linear = lib.int8_linear.default
        self._int8_linear_record = lib.int8_linear_record.default
        self._int8_gemm_isa = lib.int8_gemm_isa.default
        self._decoder_layers_ = lib.decoder_layers_.default
        self._attention_bf16_dot = lib.attention_bf16_dot.default
        self._attention_amx = lib.attention_amx.default
        self._gemm_amx = lib.gemm_amx.default
        self._gemm_bf16_fma = lib.gemm_bf16_fma.default
        self._simd = str(self._simd_level())

    def __repr__(self) -> str:
        return f"CpuOps(variant={self.variant!r}, simd_level={self._simd!r})"

    def simd_level(self) -> str:
        """The SIMD code compiled in: ``"avx512"``, ``"avx2"`` or ``"scalar"``."""
        return self._simd

    # ---- paged attention and KV blocks ------------------------------------------------------

    def paged_attention_decode(
        self,
        out: Tensor,
        query: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        block_tables: Tensor,
        seq_lens: Tensor,
        num_seqs: int,
        scale: float,
        partition_size: int = 512,
        window: int = 0,
        sinks: Tensor | None = None,
    ) -> None:
        """Decode attention of sequences ``[0, num_seqs)`` (one query token each, ``query[s]``)
        into ``out``; a context is cut at the multiples of ``partition_size`` (0: never) into
        partitions that may run on different threads and are merged (flash-decoding).
        ``window`` > 0: each query sees its last ``window`` positions only (sliding window);
        blocks before them are never read. ``sinks``: None, or ``[H]`` float32 contiguous, one
        attention-sink logit per query head (gpt-oss): it joins the softmax's denominator as a
        key of value zero, in the units of the scaled scores."""
        self._decode(
            out, query, key_cache, value_cache, block_tables, seq_lens, num_seqs, scale,
            partition_size, window, sinks,
        )  # fmt: skip

    def paged_attention_prefill(
        self,
        out: Tensor,
        query: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        block_tables: Tensor,
        seq_lens: Tensor,
        query_start_loc: Tensor,
        seq_begin: int,
        seq_end: int,
        scale: float,
        partition_size: int = 512,
        window: int = 0,
        sinks: Tensor | None = None,
    ) -> None:
        """Causal attention of sequences ``[seq_begin, seq_end)`` whose new tokens are
        ``query[query_start_loc[s] : query_start_loc[s + 1]]``, the last of ``seq_lens[s]``.
        ``window`` > 0: the token at position p sees keys ``p - window + 1 .. p`` only;
        ``sinks`` as for :meth:`paged_attention_decode`. Every query's output equals
        :meth:`paged_attention_decode`'s for that query (same ``partition_size`` and ``sinks``)
        bit for bit, so a token's attention does not depend on whether it is decoded, prefilled
        again after recompute preemption, or verified with others."""
        self._prefill(
            out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
            seq_begin, seq_end, scale, partition_size, window, sinks,
        )  # fmt: skip

    def reshape_and_cache(
        self,
        key: Tensor,
        value: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        slot_mapping: Tensor,
    ) -> None:
        """Write ``key``/``value`` ``[T, KVH, D]`` into their slots (int64; negative: skip)."""
        self._reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def copy_blocks(
        self, key_caches: list[Tensor], value_caches: list[Tensor], block_mapping: Tensor
    ) -> None:
        """Per layer, copy block ``mapping[i, 0]`` to ``mapping[i, 1]`` (int64 ``[N, 2]``)."""
        self._copy_blocks(key_caches, value_caches, block_mapping)

    def swap_blocks(self, src: Tensor, dst: Tensor, block_mapping: Tensor) -> None:
        """Copy block ``mapping[i, 0]`` of ``src`` into block ``mapping[i, 1]`` of ``dst``."""
        self._swap_blocks(src, dst, block_mapping)

    # ---- fused layer ops (float32) ------------------------------------------------------------

    def rms_norm(self, out: Tensor, x: Tensor, weight: Tensor, eps: float) -> None:
        """``out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight`` for ``[T, d]`` rows."""
        self._rms_norm(out, x, weight, eps)

    def fused_add_rms_norm(self, x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
        """``residual += x; x = rms_norm(residual) * weight``, both in place."""
        self._fused_add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, out: Tensor, gate_up: Tensor) -> None:
        """``out = silu(gate_up[:, :I]) * gate_up[:, I:]`` (``gate_up`` ``[T, 2I]``)."""
        self._silu_and_mul(out, gate_up)

    def rotary_embedding(self, x: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> None:
        """Rotate-half RoPE in place: ``x`` ``[T, heads, D]``, ``positions`` ``[T]`` int64,
        ``cos``/``sin`` ``[P, D / 2]``."""
        self._rotary_embedding(x, positions, cos, sin)

    def argmax_logsumexp(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """Per row of ``[B, V]`` logits: (first argmax ``[B]`` int64, logsumexp ``[B]``)."""
        arg, lse = self._argmax_logsumexp(logits)
        return arg, lse

    def attention_bf16_dot(self, enable: bool | None = None) -> bool:
        """Whether the attention kernels use bf16 dot products on bfloat16 KV caches (head_dim a
        multiple of 32): q and the softmax probabilities rounded to bf16, products summed in
        fp32 by ``vdpbf16ps`` (the avx512 variant on a CPU with ``avx512_bf16``; decode and
        prefill stay bit-identical to each other). Off by default on Intel CPUs without AMX
        tiles, where ``vdpbf16ps`` does half the work per second of fp32 FMAs (the kernels then
        keep fp32 arithmetic). ``enable`` turns them on / off for the process first (no effect
        where they cannot run); ``None`` only asks."""
        return bool(self._attention_bf16_dot(-1 if enable is None else int(enable)))

    def attention_amx(self, enable: bool | None = None) -> bool:
        """Whether those bf16 dot products run on AMX tiles (``TDPBF16PS``, fp32 sums; the avx512
        variant on a CPU with ``amx_bf16`` / ``amx_tile``) instead of ``vdpbf16ps``: the scores
        q . k as S^T = K Q^T, and p . V with the probabilities as A tiles and V's key pairs as
        B tiles. Decode and prefill both go through them, so they stay bit-identical to each
        other either way. ``enable`` turns them on / off for
        the process first (no effect where they cannot run); ``None`` only asks."""
        return bool(self._attention_amx(-1 if enable is None else int(enable)))

    # ---- fp32 GEMM over packed weight panels --------------------------------------------------

    def gemm_bf16_supported(self) -> bool:
        """Whether the GEMMs take bf16 panels here: the avx512 variant on a CPU with
        ``avx512_bf16`` (x is then rounded to bf16 per call; products summed in fp32)."""
        return self._gemm_bf16

    def gemm_amx(self, enable: bool | None = None) -> bool:
        """Whether the GEMMs run bf16 panels on AMX tiles (``TDPBF16PS``, fp32 sums; the avx512
        variant on a CPU with ``amx_bf16`` / ``amx_tile``, K a multiple of 32) instead of
        ``vdpbf16ps``. ``enable`` turns them on / off for the process first (no effect where
        they cannot run); ``None`` only asks."""
        return bool(self._gemm_amx(-1 if enable is None else int(enable)))

    def gemm_bf16_fma(self, enable: bool | None = None) -> bool:
        """Whether the GEMMs run bf16 panels (where AMX tiles do not) on fp32 FMAs, each bf16
        pair widened to two fp32 vectors in registers, instead of ``vdpbf16ps``: the same
        products (x rounded to bf16), summed in k order. On by default on Intel CPUs, where
        ``vdpbf16ps`` issues at a quarter of the FMA rate (half the FLOPs); off on AMD, where
        it does at least an FMA's work (Zen 4, Zen 5). ``enable`` switches it for the process first (no effect
        where bf16 panels cannot run); ``None`` only asks."""
        return bool(self._gemm_bf16_fma(-1 if enable is None else int(enable)))

    def gemm_pack_weight(self, weight: Tensor) -> Tensor:
        """``[N, K]`` float32 weight -> ``[ceil(N / 16), K, 16]`` float32 panels for
        :meth:`gemm_linear`; bfloat16 weight -> ``[ceil(N / 16), ceil(K / 2), 32]`` bfloat16
        panels of (k, k + 1) pairs (:meth:`gemm_bf16_supported`)."""
        return self._gemm_pack_weight(weight)

    def gemm_pack_swiglu_weight(self, weight: Tensor) -> Tensor:
        """Fused gate/up ``[2I, K]`` weight (gate rows first) -> panels for
        :meth:`gemm_swiglu`."""
        return self._gemm_pack_swiglu_weight(weight)

    def gemm_linear(self, x: Tensor, packed: Tensor, out_features: int) -> Tensor:
        """``x [M, K] @ W^T`` -> ``[M, out_features]`` from :meth:`gemm_pack_weight` panels."""
        return self._gemm_linear(x, packed, out_features)

    def gemm_linear_add_(self, out: Tensor, x: Tensor, packed: Tensor) -> None:
        """``out += x @ W^T`` in place."""
        self._gemm_linear_add_(out, x, packed)

    def gemm_swiglu(self, x: Tensor, packed: Tensor) -> Tensor:
        """``silu(x @ W_gate^T) * (x @ W_up^T)`` -> ``[M, I]``."""
        return self._gemm_swiglu(x, packed)

    @property
    def gguf_group_rows(self) -> int:
        """Output rows per record of the GGUF layout the fastest loops on this CPU read: 16
        with AVX512-VNNI + AVX512-BW (512-bit loops), else 8 (``PAGEDLLM_GGUF_ISA=avx2`` or
        ``avx_vnni`` forces 8). Both layouts give bit-identical outputs; 8-row records run on
        every CPU."""
        return self._gguf_group_rows

    @property
    def gguf_isa(self) -> str:
        """The GGUF loops' integer step on this CPU: ``"avx512_vnni"``, ``"avx_vnni"`` (the VEX
        vpdpbusd of AVX-VNNI CPUs without AVX-512), ``"avx2"`` (maddubs) or ``"scalar"``;
        ``PAGEDLLM_GGUF_ISA=avx2|avx_vnni`` forces a lower one. All give bit-identical outputs."""
        return self._gguf_isa

    def gguf_q4_linear(self, x: Tensor, w: Tensor, n: int) -> Tensor:
        """``x [M, K] float32 @ W^T`` -> ``[M, n]`` float32 for 4-bit affine blocks of 32 in the
        row-interleaved layout ``w [ceil(n / G), K/32, 20 G or 24 G]`` uint8, G = 8 or 16 rows
        per record (``model.quant.gguf_native.interleave``; ``csrc/cpu/quant_gguf.h``).

        Raises:
            RuntimeError: a record size of no layout, or 16-row records where the CPU lacks
                the 512-bit loops (``gguf_group_rows`` is 8).
        """
        return self._gguf_q4_linear(x, w, n)

    def gguf_q8_linear(self, x: Tensor, w: Tensor, n: int) -> Tensor:
        """``x [M, K] float32 @ W^T`` -> ``[M, n]`` float32 for signed 8-bit blocks in the
        row-interleaved layout ``w [ceil(n / G), K/32, 34 G or 40 G]`` uint8 (one float16 scale
        per 32 or two float32 per 32; G as in :meth:`gguf_q4_linear`, the same errors)."""
        return self._gguf_q8_linear(x, w, n)

    # ---- int8 W8A8 GEMM (int8_gemm.cpp) -------------------------------------------------------

    def int8_pack_weight(self, qweight: Tensor) -> Tensor:
        """``[N, K]`` int8 weight -> ``[ceil(N / 16), ceil(K / 4), 16, 4]`` int8 panels for
        :meth:`int8_linear`."""
        return self._int8_pack_weight(qweight)

    def int8_quantize_rows(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``[M, K]`` float32 -> (``[M, K]`` int8, ``[M]`` float32 scales), symmetric per row."""
        q, s = self._int8_quantize_rows(x)
        return q, s

    def int8_linear(
        self,
        x: Tensor,
        packed: Tensor,
        wscale: Tensor,
        wsum: Tensor,
        bias: Tensor | None,
        out_features: int,
    ) -> Tensor:
        """``[M, K]`` float32 x, quantized per row inside -> ``[M, out_features]`` float32."""
        return self._int8_linear(x, packed, wscale, wsum, bias, out_features)

    def int8_linear_record(
        self, x: Tensor, record: Tensor, out_features: int, bias: Tensor | None = None
    ) -> Tensor:
        """:meth:`int8_linear` on a record: one 1-D int8 tensor holding the packed panels, then
        ``wscale`` [N] float32, then ``wsum`` [panels * 16] int32 (the fused layers' form of an
        ``Int8Linear``). ``[M, K]`` float32 -> ``[M, out_features]``."""
        return self._int8_linear_record(x, record, out_features, bias)

    def int8_gemm_isa(self) -> str:
        """The int8 inner loop this CPU runs: ``"avx512_vnni"``, ``"avx_vnni"``, ``"avx2"`` or
        ``"scalar"`` (``PAGEDLLM_INT8_ISA`` forces a lower one), or ``"amx_int8"`` (AMX tiles,
        only when ``PAGEDLLM_INT8_ISA=amx_int8`` asks for them on a CPU with amx_int8)."""
        return str(self._int8_gemm_isa())

    # ---- the decoder layers of a step (fused_layer.cpp) -----------------------------------

    def decoder_layers_(
        self,
        hidden: Tensor,
        key_caches: list[Tensor],
        value_caches: list[Tensor],
        layer_args: tuple[Any, ...],
        step_args: tuple[Any, ...],
        interrupt: Tensor | None = None,
    ) -> None:
        """Pre-norm decoder layers on ``hidden [T, d]`` float32 in place, layer l with
        ``key_caches[l]`` / ``value_caches[l]`` (``csrc/cpu/fused_layer.h``).

        ``layer_args`` = (norms [2 per layer], eps, weights, kinds, rows, parts [4 per layer],
        biases [4 per layer, empty for none], windows [per layer], num_heads, num_kv_heads,
        head_dim, rotary_dims [per layer, 0 = no RoPE], scale): linear i of layer l (qkv, o,
        gate_up, down) is the next ``parts[4 l + i]`` (weight, kind, rows) entries, kinds 0 = q4,
        1 = q8, 2 = own GEMM panels, 3 = SwiGLU panels, 4 = int8 record, 5 = oneDNN packed weight. ``step_args`` = (cos, sin, rotary rows, slot_mapping, block_tables,
        seq_lens, query_start_loc, num_decodes, num_seqs, partition_size), as
        :meth:`rotary_embedding`, :meth:`reshape_and_cache` and the attention ops take them.
        ``interrupt``: an int32 [2] flag (``model.step_interrupt.StepInterrupt.flag``): element 0
        nonzero stops the call before its next layer, element 1 receives the layers run."""
        self._decoder_layers_(hidden, key_caches, value_caches, *layer_args, *step_args, interrupt)
