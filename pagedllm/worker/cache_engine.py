"""The KV cache tensors: one pool of physical blocks per layer (paper section 4.1)."""

from __future__ import annotations

import torch

from pagedllm.attention import cpu as cpu_kernels
from pagedllm.attention.kv_quant import as_copyable, cache_rows_per_block, check_head_dim
from pagedllm.device import pin_host_memory, uses_cpu_ops
from pagedllm.model.config import LlamaArchConfig
from pagedllm.worker.huge_pages import zeros_huge


def kv_block_bytes(
    config: LlamaArchConfig,
    block_size: int,
    dtype: torch.dtype,
    num_kv_heads: int | None = None,
    num_layers: int | None = None,
) -> int:
    """Bytes one physical block takes across all layers (K and V), in KV storage ``dtype``; a
    quantized (int8 / fp8) block also holds its scale row (``kv_quant``).

    ``num_kv_heads`` is the KV heads one tensor-parallel rank holds (default: all of them);
    ``num_layers`` the layers one pipeline stage holds (default: all of them).
    """
    per_row = config.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())
    if num_kv_heads is not None:
        per_row = per_row // config.num_key_value_heads * num_kv_heads
    if num_layers is not None:
        per_row = per_row // config.num_hidden_layers * num_layers
    return cache_rows_per_block(block_size, dtype) * per_row


def num_blocks_for_memory(
    config: LlamaArchConfig,
    block_size: int,
    dtype: torch.dtype,
    kv_cache_memory: int,
    num_kv_heads: int | None = None,
    num_layers: int | None = None,
) -> int:
    """How many blocks fit in ``kv_cache_memory`` bytes (at least 1); per rank with
    ``num_kv_heads`` / ``num_layers`` (see ``kv_block_bytes``)."""
    block = kv_block_bytes(config, block_size, dtype, num_kv_heads, num_layers)
    return max(1, kv_cache_memory // block)


class CacheEngine:
    """Allocates and owns the per-layer KV tensors.

    Each layer has ``key_cache`` and ``value_cache`` of shape
    [num_kv_heads, num_blocks, block_size, head_dim] in ``dtype`` on ``device`` (see
    ``attention.reference`` for why heads come first; int8 / float8_e4m3fn caches have
    block_size + 1 rows per block, the last holding the block's scale, ``attention.kv_quant``, so
    every block copy below moves the scales with the data); block ``b`` of every layer together holds
    the same ``block_size`` tokens. The swap pool has the same layout with ``num_swap_blocks``
    blocks and always lives in host memory (pinned when ``device`` is CUDA, so swaps are DMA
    copies).

    Args:
        config: model shape.
        num_blocks: physical blocks (the block manager's pool size).
        block_size: tokens per block.
        dtype: KV storage dtype (``EngineConfig.torch_kv_cache_dtype``: the model's dtype,
            bfloat16, int8 or float8_e4m3fn).
        device: where the KV pool lives (the model's device: "cpu" or "cuda:N").
        num_swap_blocks: blocks of host swap space (a separate pool in host memory, also on a
            CPU device: the device pool stays the budget the scheduler manages).
        use_cpu_kernels: copy and swap blocks with the C++ ``copy_blocks`` / ``swap_blocks``
            kernels (one parallel memcpy per block and head) instead of torch index ops; set by
            the worker when it runs the C++ attention backend, so the extension is loaded.
            Ignored unless ``device`` is the CPU.
        num_kv_heads: KV heads this tensor-parallel rank holds (default: all of the model's).
        num_layers: layers this pipeline stage holds (default: all of the model's).
    """

    def __init__(
        self,
        config: LlamaArchConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        num_swap_blocks: int = 0,
        use_cpu_kernels: bool = False,
        num_kv_heads: int | None = None,
        num_layers: int | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.use_cpu_kernels = use_cpu_kernels and uses_cpu_ops(self.device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        layers = config.num_hidden_layers if num_layers is None else num_layers
        kvh = config.num_key_value_heads if num_kv_heads is None else num_kv_heads
        check_head_dim(config.head_dim, dtype)
        rows = cache_rows_per_block(block_size, dtype)
        shape = (kvh, num_blocks, rows, config.head_dim)
        # zeros, not empty: a padded gather may read never-written slots and must not meet NaNs.
        # Huge pages: a decode step touches one 4 KiB page per block and head otherwise.
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (zeros_huge(shape, dtype, self.device), zeros_huge(shape, dtype, self.device))
            for _ in range(layers)
        ]
        swap_shape = (kvh, num_swap_blocks, rows, config.head_dim)
        pin = pin_host_memory(self.device)
        self.swap_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (
                torch.zeros(swap_shape, dtype=dtype, pin_memory=pin),
                torch.zeros(swap_shape, dtype=dtype, pin_memory=pin),
            )
            for _ in range(layers if num_swap_blocks else 0)
        ]

    @property
    def total_bytes(self) -> int:
        """Bytes of the device KV pool (all layers, K and V; the swap pool not counted)."""
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: copy block ``src`` to ``dst`` in every layer, one batched op per layer."""
        if not pairs:
            return
        if self.use_cpu_kernels:
            cpu_kernels.copy_blocks(self.kv_caches, pairs)
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=self.device)
        for k, v in self.kv_caches:
            k, v = as_copyable(k), as_copyable(v)
            k.index_copy_(1, dst, k.index_select(1, src))
            v.index_copy_(1, dst, v.index_select(1, src))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: (device, host) pairs, one batched copy per layer."""
        self._move(pairs, self.kv_caches, self.swap_caches, self.use_cpu_kernels)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks to device blocks: (host, device) pairs, one batched copy per layer."""
        self._move(pairs, self.swap_caches, self.kv_caches, self.use_cpu_kernels)

    @staticmethod
    def _move(
        pairs: list[tuple[int, int]],
        src_caches: list[tuple[torch.Tensor, torch.Tensor]],
        dst_caches: list[tuple[torch.Tensor, torch.Tensor]],
        use_cpu_kernels: bool,
    ) -> None:
        if not pairs:
            return
        if use_cpu_kernels:
            for (sk, sv), (dk, dv) in zip(src_caches, dst_caches, strict=True):
                cpu_kernels.swap_blocks(sk, dk, pairs)
                cpu_kernels.swap_blocks(sv, dv, pairs)
            return
        # One side is the device pool, the other the host pool: gather the blocks where they
        # are, copy the gathered [KVH, n, block_size, D] across once, scatter them on arrival.
        src_dev, dst_dev = src_caches[0][0].device, dst_caches[0][0].device
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=src_dev)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=dst_dev)
        for (sk, sv), (dk, dv) in zip(src_caches, dst_caches, strict=True):
            sk, sv, dk, dv = (as_copyable(t) for t in (sk, sv, dk, dv))
            dk.index_copy_(1, dst, sk.index_select(1, src).to(dst_dev))
            dv.index_copy_(1, dst, sv.index_select(1, src).to(dst_dev))
