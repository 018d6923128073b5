"""Sliding-window attention in every backend equals a dense, explicitly masked computation,
over mixed decode / prefill batches (with cached context before the new tokens)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention import get_attention_backend
from pagedllm.attention.reference import gather_kv, write_kv
from tests.attention.test_kernels import LAYOUTS, make_batch


def dense_windowed(q, kc, vc, meta, scale, window):
    """Attention of each new token over its sequence's last ``window`` positions, written as
    one masked softmax per sequence (no paging logic shared with the backends)."""
    out = torch.empty_like(q)
    g = q.shape[1] // kc.shape[0]
    starts = meta.query_start_loc_list
    for i, ctx in enumerate(meta.seq_lens_list):
        table = meta.block_tables[i].tolist()
        k = gather_kv(kc, table, ctx).repeat_interleave(g, dim=1)  # [ctx, H, D]
        v = gather_kv(vc, table, ctx).repeat_interleave(g, dim=1)
        qi = q[starts[i] : starts[i + 1]]  # [n, H, D]
        pos = torch.arange(ctx - qi.shape[0], ctx)[:, None]
        keys = torch.arange(ctx)[None, :]
        visible = (keys <= pos) & (keys > pos - window)  # [n, ctx]
        scores = torch.einsum("nhd,chd->hnc", qi, k) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        out[starts[i] : starts[i + 1]] = torch.einsum("hnc,chd->nhd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("backend", ["reference", "torch_native", "cpu"])
@pytest.mark.parametrize("window", [1, 7, 64])
@pytest.mark.parametrize("layout", LAYOUTS[:3])
def test_windowed_attention_matches_dense(backend, window, layout):
    query_lens, ctx_lens = layout
    meta, num_blocks = make_batch(query_lens, ctx_lens, 16, seed=window)
    g = torch.Generator().manual_seed(window)
    kc = torch.randn(2, num_blocks, 16, 32, generator=g)
    vc = torch.randn(2, num_blocks, 16, 32, generator=g)
    t = sum(query_lens)
    q, k, v = (torch.randn(t, n, 32, generator=g) for n in (4, 2, 2))
    kr, vr = kc.clone(), vc.clone()
    write_kv(k, v, kr, vr, meta.slot_mapping)
    want = dense_windowed(q, kr, vr, meta, 32**-0.5, window)
    got = get_attention_backend(backend).forward(q, k, v, kc, vc, meta, 32**-0.5, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
