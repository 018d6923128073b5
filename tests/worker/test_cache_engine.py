"""The KV cache on each device: layout, block copies (copy-on-write) and swapping to the host pool.

"cpu" always (with and without the C++ block-copy kernels), "cuda" where a GPU exists.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.worker.cache_engine import CacheEngine, kv_block_bytes, num_blocks_for_memory
from tests.conftest import make_tiny_config

HAS_CUDA = torch.cuda.is_available()
CASES = [
    ("cpu", False),
    ("cpu", True),
    pytest.param("cuda", False, marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")),
]


def _filled(cache: CacheEngine) -> None:
    """Give every element a distinct value (per layer, K and V differ)."""
    for i, (k, v) in enumerate(cache.kv_caches):
        n = k.numel()
        k.copy_(torch.arange(n, dtype=k.dtype).view_as(k) + 1e4 * i)
        v.copy_(-torch.arange(n, dtype=v.dtype).view_as(v) - 1e4 * i)


@pytest.mark.parametrize("device,cpu_kernels", CASES)
def test_layout_and_devices(device, cpu_kernels):
    cfg = make_tiny_config(100, 0)
    cache = CacheEngine(
        cfg, 6, 4, torch.float32, device=device, num_swap_blocks=3, use_cpu_kernels=cpu_kernels
    )
    dev = torch.device(device)
    assert len(cache.kv_caches) == cfg.num_hidden_layers
    for k, v in cache.kv_caches:
        assert k.shape == (cfg.num_key_value_heads, 6, 4, cfg.head_dim) == v.shape
        assert k.device.type == dev.type and not k.any()
    for k, _ in cache.swap_caches:
        assert k.shape[1] == 3 and k.device.type == "cpu"
        assert k.is_pinned() == (dev.type == "cuda")
    assert cache.use_cpu_kernels == (cpu_kernels and dev.type == "cpu")
    assert cache.total_bytes == 6 * kv_block_bytes(cfg, 4, torch.float32)
    assert num_blocks_for_memory(cfg, 4, torch.float32, cache.total_bytes) == 6


@pytest.mark.parametrize("device,cpu_kernels", CASES)
def test_copy_blocks_on_the_device(device, cpu_kernels):
    cfg = make_tiny_config(100, 0)
    cache = CacheEngine(cfg, 6, 4, torch.float32, device=device, use_cpu_kernels=cpu_kernels)
    _filled(cache)
    before = [(k.clone(), v.clone()) for k, v in cache.kv_caches]
    cache.copy_blocks([(1, 4), (2, 5)])
    for (k, v), (k0, v0) in zip(cache.kv_caches, before, strict=True):
        for src, dst in ((1, 4), (2, 5)):
            assert torch.equal(k[:, dst], k0[:, src]) and torch.equal(v[:, dst], v0[:, src])
        for untouched in (0, 1, 2, 3):
            assert torch.equal(k[:, untouched], k0[:, untouched])


@pytest.mark.parametrize("device,cpu_kernels", CASES)
def test_swap_out_and_back_in(device, cpu_kernels):
    cfg = make_tiny_config(100, 0)
    cache = CacheEngine(
        cfg, 6, 4, torch.float32, device=device, num_swap_blocks=3, use_cpu_kernels=cpu_kernels
    )
    _filled(cache)
    before = [(k.clone(), v.clone()) for k, v in cache.kv_caches]
    cache.swap_out([(5, 0), (2, 2)])  # (device block, host block)
    for (hk, hv), (k0, v0) in zip(cache.swap_caches, before, strict=True):
        assert torch.equal(hk[:, 0], k0[:, 5].cpu()) and torch.equal(hv[:, 2], v0[:, 2].cpu())
    for k, v in cache.kv_caches:  # the freed device blocks are reused
        k[:, [2, 5]] = 0
        v[:, [2, 5]] = 0
    cache.swap_in([(0, 1), (2, 3)])  # (host block, device block)
    for (k, v), (k0, v0) in zip(cache.kv_caches, before, strict=True):
        assert torch.equal(k[:, 1], k0[:, 5]) and torch.equal(v[:, 1], v0[:, 5])
        assert torch.equal(k[:, 3], k0[:, 2]) and torch.equal(v[:, 3], v0[:, 2])
