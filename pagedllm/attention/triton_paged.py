"""PagedAttention Triton kernels for CUDA: write K/V, paged decode, paged prefill with context.

Same contract as ``reference.paged_attention_reference``; cache layout
[num_kv_heads, num_blocks, block_size, head_dim] (contiguous), float32 / bfloat16 / float16; the
``AttentionMetadata`` index tensors are int64 (any integer dtype loads) on the same CUDA device.
This is the backend the registry (``pagedllm.attention``) picks for ``device="cuda"``.

* ``_write_kv_kernel``: one program per (token, kv head) copies a K and a V row into its slot.
* ``_decode_kernel``: one program per (decode sequence, kv head) handles the G query heads of the
  group together (each K/V tile is loaded once for all of them), walking the context in tiles of
  ``BLOCK_N`` tokens through the block table with an online softmax.
* ``_prefill_kernel``: one program per (sequence, tile of ``BLOCK_M`` query tokens, query head),
  ``tl.dot`` score tiles with a causal mask offset by the cached context length.

Attention sinks (gpt-oss; ``HAS_SINKS``): after the last tile each query's (max, sum, acc) state
takes its head's sink logit as one more key of value zero, before the division by the sum.

Without a CUDA device the kernels are defined in Triton's interpreter mode (``TRITON_INTERPRET=1``
is set before Triton is imported, unless the caller chose a value), so the tests can run them on
CPU tensors; that is slow (tens of ms per launch) and only meant for testing.
"""

from __future__ import annotations

import os
import sys

import torch

from pagedllm.attention.metadata import AttentionMetadata

_IMPORT_ERROR: str | None = None
if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    if "triton" in sys.modules:
        # Triton's own @jit helpers (tl.sum, tl.max...) were already compiled for the GPU path,
        # so the interpreter cannot run our kernels in this process.
        _IMPORT_ERROR = (
            "no CUDA device, and triton was imported before TRITON_INTERPRET=1 was set "
            "(run in a process that sets it first)"
        )
    else:
        os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton
    import triton.language as tl
except Exception as e:  # noqa: BLE001 - triton missing or broken: report, never crash the import
    triton = None
    tl = None
    _IMPORT_ERROR = f"triton unavailable: {type(e).__name__}: {e}"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unavailable_reason() -> str | None:
    """``None`` if the kernels can run here (on CUDA, or interpreted on the CPU), else why not."""
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if not torch.cuda.is_available() and not interpreting():
        return "no CUDA device and TRITON_INTERPRET is off"
    return None


def triton_available() -> bool:
    """True when the kernels can run on a CUDA device (not just interpreted)."""
    return _IMPORT_ERROR is None and torch.cuda.is_available() and not interpreting()


if triton is not None:

    @triton.jit
    def _write_kv_kernel(
        key, value, key_cache, value_cache, slots,
        stride_kt, stride_kh, stride_vt, stride_vh, stride_ch,
        D: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        slot = tl.load(slots + t).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        mask = (d < D) & ((slot + tl.zeros([BLOCK_D], tl.int64)) >= 0)
        dst = h * stride_ch + slot * D + d
        k = tl.load(key + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(value + t * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(key_cache + dst, k, mask=mask)
        tl.store(value_cache + dst, v, mask=mask)

    @triton.jit
    def _decode_kernel(
        out, query, key_cache, value_cache, block_tables, seq_lens, sinks, scale, window,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_ch, stride_bt,
        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
        BS: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SINKS: tl.constexpr,
    ):  # fmt: skip
        s = tl.program_id(0)
        kh = tl.program_id(1)
        ctx = tl.load(seq_lens + s)
        g = tl.arange(0, GP)
        d = tl.arange(0, BLOCK_D)
        gmask = g < G
        dmask = d < D
        heads = kh * G + g
        q = tl.load(
            query + s * stride_qt + heads[:, None] * stride_qh + d[None, :],
            mask=gmask[:, None] & dmask[None, :],
            other=0.0,
        ).to(tl.float32)
        q = q * scale
        base = kh.to(tl.int64) * stride_ch
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, BLOCK_D], tl.float32)
        # the query (position ctx - 1) sees keys ctx - window .. ctx - 1; earlier ones are not read
        for start in range(tl.maximum(ctx - window, 0), ctx, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            nmask = n < ctx
            blk = tl.load(block_tables + s * stride_bt + n // BS, mask=nmask, other=0)
            row = blk.to(tl.int64) * BS + n % BS
            kv_off = base + row[:, None] * D + d[None, :]
            kv_mask = nmask[:, None] & dmask[None, :]
            k = tl.load(key_cache + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
            sc = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GP, BLOCK_N]
            sc = tl.where(nmask[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(value_cache + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        if HAS_SINKS:  # one more key per head: score = its sink, value 0
            sk = tl.load(sinks + heads, mask=gmask, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m_i, sk)
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.exp(sk - m_new)
            acc = acc * alpha[:, None]
        acc = acc / l_i[:, None]
        tl.store(
            out + s * stride_ot + heads[:, None] * stride_oh + d[None, :],
            acc.to(out.dtype.element_ty),
            mask=gmask[:, None] & dmask[None, :],
        )

    @triton.jit
    def _prefill_kernel(
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, sinks,
        seq_begin, scale, window,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_ch, stride_bt,
        G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SINKS: tl.constexpr,
    ):  # fmt: skip
        s = seq_begin + tl.program_id(0)
        mt = tl.program_id(1)
        h = tl.program_id(2)
        q_lo = tl.load(query_start_loc + s)
        qlen = tl.load(query_start_loc + s + 1) - q_lo
        if mt * BLOCK_M < qlen:
            ctx = tl.load(seq_lens + s)
            first = ctx - qlen
            m_idx = mt * BLOCK_M + tl.arange(0, BLOCK_M)
            mmask = m_idx < qlen
            qpos = first + m_idx
            d = tl.arange(0, BLOCK_D)
            dmask = d < D
            rows = (q_lo + m_idx).to(tl.int64)
            q = tl.load(
                query + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=mmask[:, None] & dmask[None, :],
                other=0.0,
            ).to(tl.float32)
            q = q * scale
            base = (h // G).to(tl.int64) * stride_ch
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            end = tl.minimum(ctx, first + (mt + 1) * BLOCK_M)  # keys up to the tile's last query
            # keys from the window start of the tile's first query (none before it are read)
            for start in range(tl.maximum(first + mt * BLOCK_M - window + 1, 0), end, BLOCK_N):
                n = start + tl.arange(0, BLOCK_N)
                nmask = n < end
                blk = tl.load(block_tables + s * stride_bt + n // BS, mask=nmask, other=0)
                row = blk.to(tl.int64) * BS + n % BS
                kv_off = base + row[:, None] * D + d[None, :]
                kv_mask = nmask[:, None] & dmask[None, :]
                k = tl.load(key_cache + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
                sc = tl.dot(q, tl.trans(k), input_precision="ieee")
                visible = (n[None, :] <= qpos[:, None]) & (n[None, :] > qpos[:, None] - window)
                visible = visible & nmask[None, :]
                sc = tl.where(visible, sc, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(sc, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m_i - m_safe)
                p = tl.exp(sc - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                v = tl.load(value_cache + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
                m_i = m_new
            if HAS_SINKS:  # one more key: score = the head's sink, value 0
                sk = tl.load(sinks + h).to(tl.float32)
                m_new = tl.maximum(m_i, sk)
                alpha = tl.exp(m_i - m_new)
                l_i = l_i * alpha + tl.exp(sk - m_new)
                acc = acc * alpha[:, None]
            acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(
                out + rows[:, None] * stride_ot + h * stride_oh + d[None, :],
                acc.to(out.dtype.element_ty),
                mask=mmask[:, None] & dmask[None, :],
            )


# A window longer than any context: full causal attention, with no branch in the kernels.
_NO_WINDOW = 1 << 30


def _next_pow2(x: int, lo: int = 1) -> int:
    return max(lo, 1 << (max(x, 1) - 1).bit_length())


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``reshape_and_cache``: K/V rows [T, KVH, D] into their slots (slot < 0 skipped)."""
    t, kvh, d = key.shape
    if t == 0:
        return
    assert key.stride(2) == 1 and value.stride(2) == 1 and key_cache.is_contiguous()
    _write_kv_kernel[(t, kvh)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), key_cache.stride(0),
        D=d, BLOCK_D=_next_pow2(d),
    )  # fmt: skip


class TritonPagedAttention:
    """Paged attention with Triton kernels (CUDA; the interpreter on CPU tensors for tests).

    Args:
        block_n: context tokens per tile of the decode kernel.
        block_m: query tokens per tile of the prefill kernel.

    Raises:
        RuntimeError: Triton cannot run here (``unavailable_reason``).
    """

    name = "triton"

    def __init__(self, block_n: int = 64, block_m: int = 16) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"triton attention backend: {reason}")
        self.block_n = block_n
        self.block_m = block_m
        self._interpret = interpreting()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        *,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write K/V of the new tokens, then attend.

        Args:
            query: [T, H, D]; key, value: [T, KVH, D] (last dim contiguous).
            key_cache, value_cache: [KVH, num_blocks, block_size, D], contiguous.
            meta: batch layout, index tensors on the same device.
            scale: softmax scale.
            sliding_window: attend to the last ``sliding_window`` positions only; keys before
                each query's window are not read (freed blocks behind the window are safe).
            sinks: [H] attention-sink logits (gpt-oss), or None.

        Returns:
            [T, H, D], dtype and device of ``query``.

        Raises:
            ValueError: the tensors are not on a CUDA device (outside the interpreter).
        """
        if not self._interpret and query.device.type != "cuda":
            raise ValueError(
                f"triton attention backend needs CUDA tensors, got {query.device} "
                "(device must be 'cuda' for attention_backend 'triton')"
            )
        if key_cache.dtype != query.dtype:
            # A KV dtype other than the model's (bf16 KV, int8 / fp8 with scales): the Triton
            # kernels read same-dtype caches only, so take the portable torch path.
            from pagedllm.attention.torch_native import TorchNativeAttention

            return TorchNativeAttention().forward(
                query, key, value, key_cache, value_cache, meta, scale, sliding_window,
                sinks=sinks,
            )  # fmt: skip
        write_kv_triton(key, value, key_cache, value_cache, meta.slot_mapping)
        if query.stride(-1) != 1:
            query = query.contiguous()
        out = torch.empty_like(query)
        _, h, d = query.shape
        kvh, _, bs, _ = key_cache.shape
        g = h // kvh
        tables = meta.block_tables
        block_d = _next_pow2(d, 16)
        nd, ns = meta.num_decodes, meta.num_seqs
        window = sliding_window or _NO_WINDOW
        has_sinks = sinks is not None
        # Without sinks the kernels never read the pointer: any tensor stands in.
        sink_ptr = sinks.float().contiguous() if sinks is not None else query
        if nd:
            _decode_kernel[(nd, kvh)](
                out, query, key_cache, value_cache, tables, meta.seq_lens, sink_ptr, scale,
                window, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                key_cache.stride(0), tables.stride(0),
                G=g, GP=_next_pow2(g), D=d, BLOCK_D=block_d, BS=bs, BLOCK_N=self.block_n,
                HAS_SINKS=has_sinks,
            )  # fmt: skip
        if nd < ns:
            max_q = max(meta.query_lens_list[nd:])
            grid = (ns - nd, triton.cdiv(max_q, self.block_m), h)
            _prefill_kernel[grid](
                out, query, key_cache, value_cache, tables, meta.seq_lens,
                meta.query_start_loc, sink_ptr, nd, scale, window,
                query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                key_cache.stride(0), tables.stride(0),
                G=g, D=d, BLOCK_D=block_d, BS=bs, BLOCK_M=self.block_m, BLOCK_N=32,
                HAS_SINKS=has_sinks,
            )  # fmt: skip
        return out
