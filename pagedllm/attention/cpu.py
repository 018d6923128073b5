"""PagedAttention on the C++ CPU kernels behind the attention backend interface.

The kernels (``pagedllm/csrc/cpu/``) are built, cached and loaded by :mod:`pagedllm.ops.loader`,
one instruction-set variant per CPU kind (avx512, avx2 or scalar), and called through the typed
:class:`pagedllm.ops.CpuOps` (``torch.ops.pagedllm.<name>``). When they cannot be built,
``load_cpu_ops`` returns ``None`` after one warning and ``CpuPagedAttention`` runs
``TorchNativeAttention`` instead.

``load_cpu_ops``, ``cpu_ops_available`` and ``cpu_ops_error`` are re-exported here from
:mod:`pagedllm.ops` for existing callers.
"""

from __future__ import annotations

import torch

from pagedllm.attention.kv_quant import as_copyable
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_native import TorchNativeAttention
from pagedllm.ops import CpuOps, cpu_ops_available, cpu_ops_error, load_cpu_ops

__all__ = [
    "CpuPagedAttention",
    "copy_blocks",
    "cpu_ops_available",
    "cpu_ops_error",
    "load_cpu_ops",
    "swap_blocks",
]


# KV cache storages the kernels read and write (int8 / fp8 with their scale rows, ``kv_quant``).
_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn)


class CpuPagedAttention:
    """Paged attention on the C++ CPU kernels; falls back to ``TorchNativeAttention`` when the
    extension is unavailable or the tensors are not float32 / bfloat16 CPU tensors. The KV cache
    may be float32, bfloat16, int8 or fp8 e4m3 whatever the activation dtype (quantized caches:
    codes are dequantized in registers, ``kv_quant``).

    Decodes (the first ``meta.num_decodes`` sequences) go to ``paged_attention_decode``, the
    multi-token sequences to ``paged_attention_prefill``; both read K/V in place through the block
    tables, and give a query the same output bits. ``partition_size``: keys are cut into
    partitions at its multiples (positions), merged flash-decoding style, so a long decode
    context can be split across threads; both kernels must use the same value (0: no cut).
    """

    name = "cpu"

    def __init__(self, partition_size: int = 512) -> None:
        self.partition_size = partition_size
        self.ops: CpuOps | None = load_cpu_ops()
        self._fallback = TorchNativeAttention()

    @property
    def is_native(self) -> bool:
        """True when the C++ kernels are in use."""
        return self.ops is not None

    @staticmethod
    def plan(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Once per step: int64 contiguous block tables, seq lens and query starts."""
        plan = meta.backend_cache.get("cpu")
        if plan is None:
            plan = (
                meta.block_tables.to(torch.int64).contiguous(),
                meta.seq_lens.to(torch.int64).contiguous(),
                meta.query_start_loc.to(torch.int64).contiguous(),
            )
            meta.backend_cache["cpu"] = plan
        return plan

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
        """Write K/V of the new tokens into their slots, then attend (see
        ``reference.paged_attention_reference`` for the contract). ``sliding_window``: the
        kernels read only the keys inside each query's window, so table entries of blocks
        wholly before it (freed by the block manager) are never dereferenced. ``sinks``: [H]
        attention-sink logits (gpt-oss), or None; both kernels fold them in the same way, so
        a query's decode and prefill outputs stay bit-identical."""
        ops = self.ops
        if (
            ops is None
            or query.device.type != "cpu"
            or query.dtype not in (torch.float32, torch.bfloat16)
            or key_cache.dtype not in _CACHE_DTYPES
        ):
            return self._fallback.forward(
                query, key, value, key_cache, value_cache, meta, scale, sliding_window,
                sinks=sinks,
            )  # fmt: skip
        ops.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping)
        if query.stride(-1) != 1:
            query = query.contiguous()
        out = torch.empty_like(query)
        tables, seq_lens, starts = self.plan(meta)
        window = sliding_window or 0  # the kernels' "no window"
        if sinks is not None:
            sinks = sinks.float().contiguous()
        nd, ns = meta.num_decodes, meta.num_seqs
        if nd:
            ops.paged_attention_decode(
                out,
                query,
                key_cache,
                value_cache,
                tables,
                seq_lens,
                nd,
                scale,
                self.partition_size,
                window,
                sinks,
            )
        if nd < ns:
            ops.paged_attention_prefill(
                out, query, key_cache, value_cache, tables, seq_lens, starts, nd, ns, scale,
                self.partition_size, window, sinks,
            )  # fmt: skip
        return out


def copy_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]
) -> None:
    """Copy-on-write for every layer with the C++ kernel (torch index ops when unavailable)."""
    if not pairs:
        return
    mapping = torch.tensor(pairs, dtype=torch.int64).view(-1, 2)
    ops = load_cpu_ops()
    if ops is not None and all(k.device.type == "cpu" for k, _ in kv_caches):
        ops.copy_blocks([k for k, _ in kv_caches], [v for _, v in kv_caches], mapping)
        return
    src, dst = mapping[:, 0], mapping[:, 1]
    for k, v in kv_caches:
        k, v = as_copyable(k), as_copyable(v)
        k.index_copy_(1, dst.to(k.device), k.index_select(1, src.to(k.device)))
        v.index_copy_(1, dst.to(v.device), v.index_select(1, src.to(v.device)))


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copy block ``a`` of ``src`` into block ``b`` of ``dst`` for each (a, b) pair."""
    if not pairs:
        return
    mapping = torch.tensor(pairs, dtype=torch.int64).view(-1, 2)
    ops = load_cpu_ops()
    if ops is not None and src.device.type == "cpu" and dst.device.type == "cpu":
        ops.swap_blocks(src, dst, mapping)
        return
    s, d = mapping[:, 0].to(src.device), mapping[:, 1].to(dst.device)
    src, dst = as_copyable(src), as_copyable(dst)
    dst.index_copy_(1, d, src.index_select(1, s).to(dst.device))
