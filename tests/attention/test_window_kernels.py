"""The C++ CPU kernels with a sliding window equal the reference attention, and never read the
blocks that lie wholly before every query's window (the block manager frees those)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.attention.test_kernels import TOL, random_case, random_layout


@pytest.fixture(scope="module")
def cpu_backend():
    from pagedllm.attention.cpu import CpuPagedAttention, cpu_ops_error

    backend = CpuPagedAttention(partition_size=64)  # small partitions: the split path too
    if not backend.is_native:
        pytest.skip(f"C++ CPU kernels unavailable: {cpu_ops_error()}")
    return backend


def _with_nan_block(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` [KVH, NB, BS, D] with one more block, full of NaN, at id NB."""
    nan = torch.full_like(cache[:, :1], float("nan"))
    return torch.cat([cache, nan], dim=1)


def _poison_outside_window(meta, nan_block: int, block_size: int, window: int) -> None:
    """Point every table entry of a block wholly before its sequence's first query window at
    the NaN block: a kernel that read it would return NaN."""
    for i, (ctx, q) in enumerate(zip(meta.seq_lens_list, meta.query_lens_list, strict=True)):
        first_needed = max(0, ctx - q - window + 1)  # the first query's window start
        meta.block_tables[i, : first_needed // block_size] = nan_block


@pytest.mark.parametrize("block_size", [1, 16, 128])
@pytest.mark.parametrize("window", [None, 1, 5, 33, 128])
def test_windowed_kernels_match_reference(cpu_backend, block_size, window):
    """Random GQA shapes and decode / prefill / chunk mixes, fp32 and bf16; with a window the
    blocks before it hold NaN and the output stays finite and equal to the reference."""
    from pagedllm.attention.reference import paged_attention_reference

    rng = random.Random(block_size * 1000 + (window or 0))
    for trial in range(4):
        qlens, ctx = random_layout(rng, 4, 45, 400, 300)
        kvh, group = rng.choice([1, 2]), rng.choice([1, 2, 5, 8])
        hd = rng.choice([16, 24, 64])
        dtype = torch.bfloat16 if trial == 3 else torch.float32
        meta, (q, k, v, kc, vc), (_, kr, vr) = random_case(
            qlens, ctx, block_size, kvh * group, kvh, hd, dtype, seed=trial
        )
        if window is not None:
            nan_block = kc.shape[1]
            kc, vc, kr, vr = (_with_nan_block(c) for c in (kc, vc, kr, vr))
            _poison_outside_window(meta, nan_block, block_size, window)
        out = cpu_backend.forward(q, k, v, kc, vc, meta, hd**-0.5, window)
        # the reference gathers whole contexts: give it unpoisoned copies of the keys it reads
        ref = paged_attention_reference(
            q, torch.nan_to_num(kr), torch.nan_to_num(vr), meta, hd**-0.5, window
        )
        assert torch.isfinite(out.float()).all()
        torch.testing.assert_close(out, ref, **TOL[dtype])


def test_window_longer_than_context_is_full_attention(cpu_backend):
    """A window at least as long as every context changes nothing."""
    meta, (q, k, v, kc, vc), (ref, _, _) = random_case(
        [1, 1, 20], [50, 7, 60], 16, 8, 2, 32, torch.float32, seed=3
    )
    out = cpu_backend.forward(q, k, v, kc, vc, meta, 32**-0.5, 60)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
