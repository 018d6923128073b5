"""Attention-logit soft-capping (Gemma 2): the reference equals contiguous soft-capped causal
attention, torch_native equals the reference (decodes, prefills with cached context, with and
without a sliding window), and kernels without a soft cap hand such layers to torch_native."""

import pytest
import torch

from pagedllm.attention import get_attention_backend
from pagedllm.attention.reference import paged_attention_reference, write_kv
from pagedllm.attention.torch_native import TorchNativeAttention
from pagedllm.model.layers.attention import soft_cap_backend
from tests.attention.test_paged_attention import build_batch

CAP = 1.5


def test_reference_equals_contiguous_soft_capped_attention():
    torch.manual_seed(0)
    heads, kvh, hd, n, bs = 4, 2, 8, 13, 4
    meta, _ = build_batch([n], [n], bs, 8, kvh, hd, seed=1)
    q, k, v = torch.randn(n, heads, hd), torch.randn(n, kvh, hd), torch.randn(n, kvh, hd)
    kc, vc = torch.zeros(kvh, 8, bs, hd), torch.zeros(kvh, 8, bs, hd)
    write_kv(k, v, kc, vc, meta.slot_mapping)
    got = paged_attention_reference(q, kc, vc, meta, 0.5, logits_soft_cap=CAP)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * 0.5
    scores = CAP * torch.tanh(scores / CAP)
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    plain = paged_attention_reference(q, kc, vc, meta, 0.5)
    assert (got - plain).abs().max() > 1e-2  # the cap changes the result


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("block_size", [1, 16])
def test_torch_native_soft_cap_matches_reference(window, block_size):
    torch.manual_seed(block_size)
    heads, kvh, hd = 6, 2, 16
    query_lens, ctx_lens = [1, 1, 5, 17, 9], [3, 30, 5, 40, 9]
    num_blocks = sum(-(-c // block_size) for c in ctx_lens) + 2
    meta, _ = build_batch(query_lens, ctx_lens, block_size, num_blocks, kvh, hd, seed=3)
    shape = (kvh, num_blocks, block_size, hd)
    kc, vc = torch.randn(shape), torch.randn(shape)
    t = sum(query_lens)
    q, k, v = torch.randn(t, heads, hd), torch.randn(t, kvh, hd), torch.randn(t, kvh, hd)
    kc2, vc2 = kc.clone(), vc.clone()
    write_kv(k, v, kc, vc, meta.slot_mapping)
    ref = paged_attention_reference(q, kc, vc, meta, hd**-0.5, window, CAP)
    out = TorchNativeAttention().forward(q, k, v, kc2, vc2, meta, hd**-0.5, window, CAP)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def test_backends_without_soft_cap_fall_back_to_torch_native():
    native = get_attention_backend("torch_native")
    reference = get_attention_backend("reference")
    assert soft_cap_backend(native) is native and soft_cap_backend(reference) is reference
    try:
        cpu = get_attention_backend("cpu")
    except (RuntimeError, ValueError):
        pytest.skip("C++ CPU backend unavailable")
    assert isinstance(soft_cap_backend(cpu), TorchNativeAttention)
