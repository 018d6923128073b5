"""Quantized KV cache (int8, fp8 e4m3): block layout, scales, write and dequantize in torch.

Choice (issue 22 item 5): one float32 scale per (block, KV head), separately for K and V,
**stored inside the block** as one extra row. A quantized cache tensor is
[num_kv_heads, num_blocks, block_size + 1, head_dim] of ``torch.int8`` or
``torch.float8_e4m3fn``: rows ``0 .. block_size - 1`` hold the tokens, row ``block_size`` holds
the scale in its first 4 bytes (the rest is zero). So a block and its scales are one contiguous
run of bytes per head: swap in/out, copy-on-write and every other block move carry the scales
without knowing about them. The cost is ``head_dim`` bytes per block and head instead of 4
(1 / block_size of the pool: 6 % at block size 16).

Scale rule (running absmax with requantization): ``scale = absmax / qmax`` (qmax 127 for int8,
448 for fp8 e4m3), where absmax is the largest |x| written to that block-head so far. A block
starts with scale 0, and a write at offset 0 starts it afresh (scale 0 again: a block reused by
another sequence does not inherit its previous owner's scale). When a write raises the absmax, the rows already in the block are
requantized to the new scale (``q' = round(q * old / new)``, one extra rounding for those rows)
before the new rows are quantized; so no value is ever clamped. Dequantized value = ``q * scale``.
int8 rounds to nearest even; fp8 uses torch's / c10's round-to-nearest-even conversion after a
clamp to +-448. The C++ kernels (``csrc/cpu/paged_attention.cpp``) implement the same rule and
produce the same bytes.

Everything here is the portable path (torch ops, any device); the C++ kernels are the fast one.
"""

from __future__ import annotations

import torch

#: ``EngineConfig.kv_cache_dtype`` values; "auto" = the model dtype.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "fp8_e4m3", "int8")

_NAMED = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "int8": torch.int8,
}

#: Largest representable magnitude per quantized storage dtype.
QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def parse_kv_cache_dtype(name: str | torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the KV cache storage for an ``EngineConfig.kv_cache_dtype`` value.

    Args:
        name: one of ``KV_CACHE_DTYPES`` or a torch dtype among their storages.
        model_dtype: what "auto" resolves to.

    Raises:
        ValueError: naming ``kv_cache_dtype`` for anything else.
    """
    if isinstance(name, torch.dtype):
        if name in _NAMED.values() or name == model_dtype:
            return name
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name}")
    if name == "auto":
        return model_dtype
    if name not in _NAMED:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}"
        )
    return _NAMED[name]


def is_quantized(dtype: torch.dtype) -> bool:
    """True for the scaled storages (int8, fp8 e4m3)."""
    return dtype in QMAX


def cache_rows_per_block(block_size: int, dtype: torch.dtype) -> int:
    """Rows of ``head_dim`` values per block in the cache tensor (one more for the scale row)."""
    return block_size + 1 if is_quantized(dtype) else block_size


def kv_dtype_bytes_per_token(dtype: torch.dtype, block_size: int) -> float:
    """Storage bytes per cached value, scales included (e.g. 4, 2, or (bs + 1) / bs)."""
    size = torch.empty((), dtype=dtype).element_size()
    return size * cache_rows_per_block(block_size, dtype) / block_size


def check_head_dim(head_dim: int, dtype: torch.dtype) -> None:
    """The scale row holds a float32 in its first 4 bytes, aligned: head_dim % 4 == 0.

    Raises:
        ValueError: naming ``kv_cache_dtype`` when the model's head_dim does not allow it.
    """
    if is_quantized(dtype) and head_dim % 4:
        raise ValueError(
            f"kv_cache_dtype {dtype} needs head_dim divisible by 4 (its scale row), got {head_dim}"
        )


def as_copyable(cache: torch.Tensor) -> torch.Tensor:
    """A byte view of an fp8 cache (torch has no ``index_copy_`` for float8), else ``cache``:
    block copies move bytes, so the view is exact."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


def block_scales(cache: torch.Tensor) -> torch.Tensor:
    """The per-(head, block) scales of a quantized cache as a writable float32 view [KVH, NB]."""
    return cache.view(torch.uint8)[:, :, -1, :4].view(torch.float32)[..., 0]


def dequantize_blocks(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[KVH, n, block_size + 1, D] quantized blocks -> [KVH, n, block_size, D] values in ``dtype``."""
    scales = block_scales(blocks)
    return (blocks[:, :, :-1].to(torch.float32) * scales[:, :, None, None]).to(dtype)


def dequantize_cache(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A cache in ``dtype`` with the plain [KVH, NB, block_size, D] layout (a copy when
    quantized, ``cache`` itself otherwise)."""
    if not is_quantized(cache.dtype):
        return cache.to(dtype)
    return dequantize_blocks(cache, dtype)


def gather_blocks(cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks ``index`` of every head as [KVH, len(index), block_size, D] values in ``dtype``
    (a bf16 cache read by a float32 model is widened)."""
    blocks = cache.index_select(1, index)
    return dequantize_blocks(blocks, dtype) if is_quantized(cache.dtype) else blocks.to(dtype)


def _quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 values already divided by their scale -> ``dtype`` codes (clamped, RNE)."""
    q = QMAX[dtype]
    x = x.clamp(-q, q)
    return x.round().to(dtype) if dtype == torch.int8 else x.to(dtype)


def write_quantized(x: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize and store new tokens into a quantized cache (running absmax, see module doc).

    Args:
        x: [T, KVH, D] new keys or values (any float dtype).
        cache: [KVH, NB, block_size + 1, D] int8 or float8_e4m3fn.
        slot_mapping: [T] int64 slots (block * block_size + offset); negative = skip.
    """
    bs = cache.shape[2] - 1
    keep = slot_mapping >= 0
    slots, x = slot_mapping[keep], x[keep].to(torch.float32)
    if slots.numel() == 0:
        return
    kvh = cache.shape[0]
    blk, off = slots // bs, slots % bs
    uniq, inv = torch.unique(blk, return_inverse=True)
    tok_amax = x.abs().amax(-1).transpose(0, 1)  # [KVH, T]
    amax = torch.zeros(kvh, uniq.numel(), dtype=torch.float32, device=x.device)
    amax.scatter_reduce_(1, inv.expand(kvh, -1), tok_amax, "amax")
    scales = block_scales(cache)
    # A block written at offset 0 starts afresh: a reused block forgets its last owner's scale.
    fresh = torch.zeros(uniq.numel(), dtype=torch.bool, device=x.device)
    fresh[inv[off == 0]] = True
    old = scales[:, uniq].masked_fill(fresh, 0.0)
    new = torch.maximum(old, amax / QMAX[cache.dtype])
    grow = (new > old) & (old > 0)
    if bool(grow.any()):
        ratio = torch.where(grow, old / new, torch.ones_like(old))  # 1 keeps a row exact
        rows = cache[:, uniq, :-1].to(torch.float32) * ratio[:, :, None, None]
        cache[:, uniq, :-1] = _quantize(rows, cache.dtype)
    scales[:, uniq] = new
    s = new[:, inv]  # [KVH, T]
    s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero row stays zero
    codes = _quantize(x.transpose(0, 1) / s[:, :, None], cache.dtype)  # [KVH, T, D]
    cache[:, blk, off] = codes
