"""The bf16 CPU step: the C++ RMSNorm / SwiGLU / rotary kernels on bf16 rows (fp32 arithmetic,
one rounding), bf16 weights prepacked for oneDNN where the CPU has bf16 hardware, and the whole
bf16 model on that path as close to fp32 as the plain ATen bf16 model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.model.layers.fused_layer import KIND_GEMM, KIND_ONEDNN, KIND_SWIGLU
from pagedllm.model.packed_linear import (
    PackedLinear,
    bf16_packing_available,
    cpu_gemm_ops,
    onednn_linear_available,
    packed_linear_available,
)
from pagedllm.platform import CpuFlags
from tests.model.test_cpu_fast_path import _prefill_then_decode

BF16 = torch.bfloat16
needs_bf16_hardware = pytest.mark.skipif(
    not bf16_packing_available() or not onednn_linear_available(BF16),
    reason="bf16 weights are packed only on CPUs with amx_bf16 or avx512_bf16 (this CPU has "
    "neither in /proc/cpuinfo) and PyTorch with MKL-DNN",
)


def _close_to_rounded(got: torch.Tensor, want_fp32: torch.Tensor) -> None:
    """``got`` (bf16) is the fp32 reference rounded once: equal in at least 99 % of the values
    (the kernels' fp32 sums run in another order than ATen's) and within one bf16 step."""
    want = want_fp32.to(BF16)
    assert got.dtype == BF16 and got.shape == want.shape
    assert (got == want).float().mean().item() >= 0.99
    torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=2**-7)


@pytest.mark.parametrize("t, d", [(1, 576), (64, 576), (7, 13), (300, 1536)])
def test_bf16_layer_ops_are_fp32_arithmetic_rounded_once(cpu_ops, t, d):
    ops = cpu_ops
    torch.manual_seed(t * d)
    x, w, r = torch.randn(t, d).to(BF16), torch.randn(d).to(BF16), torch.randn(t, d).to(BF16)

    def norm(h: torch.Tensor) -> torch.Tensor:
        hf = h.float()
        return hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()

    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-5)
    _close_to_rounded(out, norm(x))
    x2, r2 = x.clone(), r.clone()
    ops.fused_add_rms_norm(x2, r2, w, 1e-5)
    h = (r.float() + x.float()).to(BF16)  # the residual stream is bf16: rounded, then normed
    assert torch.equal(r2, h)
    _close_to_rounded(x2, norm(h))
    gu = (torch.randn(t, 2 * d) * 4).to(BF16)
    act = torch.empty(t, d, dtype=BF16)
    ops.silu_and_mul(act, gu)
    _close_to_rounded(act, F.silu(gu[:, :d].float()) * gu[:, d:].float())


def test_bf16_rotary_kernel_on_a_strided_view(cpu_ops):
    """q and k heads rotated in place inside a fused [T, (H + 2 KVH) D] row (V untouched), with
    fp32 cos / sin tables."""
    ops = cpu_ops
    torch.manual_seed(3)
    t, heads, d = 5, 6, 64
    qkv = torch.randn(t, (heads + 2) * d).to(BF16)
    before = qkv.clone()
    pos = torch.tensor([0, 3, 9, 4, 1])
    cos, sin = torch.randn(10, d // 2), torch.randn(10, d // 2)
    ops.rotary_embedding(qkv[:, : heads * d].view(t, heads, d), pos, cos, sin)
    x = before[:, : heads * d].view(t, heads, d).float()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    want = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    _close_to_rounded(qkv[:, : heads * d].view(t, heads, d), want)
    assert torch.equal(qkv[:, heads * d :], before[:, heads * d :])


def test_bf16_store_rounds_ties_to_even_and_keeps_specials(cpu_ops):
    """The vector fp32 -> bf16 store: inf, NaN and subnormals kept (rms_norm of a row of ones
    times the weight gives the weight's values back through the store), ties to even."""
    ops = cpu_ops
    specials = [float("nan"), float("inf"), -float("inf"), 1.0, 65504.0, -3.0e38, 1e-40, 0.0]
    w = torch.tensor(specials * 2).to(BF16)
    out = torch.empty(1, 16, dtype=BF16)
    ops.rms_norm(out, torch.ones(1, 16, dtype=BF16), w, 0.0)
    assert torch.equal(out[0].isnan(), w.isnan())
    finite = ~w.isnan()
    assert torch.equal(out[0][finite], w[finite])
    # Rotating (1, 0) by a table entry stores its fp32 cos and sin: 1 + 2^-8 lies halfway
    # between two bf16 values and goes to the even one (1.0), 1 + 3 * 2^-8 up to 1 + 2^-6.
    cos = torch.tensor([[1 + 2**-8, 1 + 3 * 2**-8] * 16])
    sin = torch.tensor([[-(1 + 2**-8), 2.0**-130] * 16])
    x = torch.cat([torch.ones(1, 1, 32), torch.zeros(1, 1, 32)], -1).to(BF16)
    ops.rotary_embedding(x, torch.tensor([0]), cos, sin)
    assert torch.equal(x[0, 0, :2].float(), torch.tensor([1.0, 1 + 2**-6]))
    assert torch.equal(x[0, 0, 32:34].float(), torch.tensor([-1.0, 2.0**-130]).to(BF16).float())


def test_bf16_packing_rule_follows_the_cpu_flags(monkeypatch):
    """bf16 weights are packed for oneDNN only with AMX-BF16 or AVX512-BF16; fp32 always."""
    import pagedllm.platform as platform

    for flags, packs in (
        (CpuFlags(avx2=True, fma=True), False),
        (CpuFlags(avx512f=True, avx512_bf16=True), True),
        (CpuFlags(avx512f=True, amx_bf16=True), True),
    ):
        monkeypatch.setattr(platform, "cpu_flags", lambda flags=flags: flags)
        assert bf16_packing_available() is packs
        if onednn_linear_available(torch.float32):
            assert packed_linear_available(BF16) is packs
            assert packed_linear_available(torch.float32)
    assert not packed_linear_available(torch.float16)


@needs_bf16_hardware
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_bf16_packed_linear_matches_f_linear(rows):
    torch.manual_seed(rows)
    w, b = torch.randn(960, 576).to(BF16), torch.randn(960).to(BF16)
    x = torch.randn(rows, 576).to(BF16)
    layer = PackedLinear(w, None, b)
    assert layer.kernel == "onednn"
    want = x.float() @ w.float().T + b.float()
    got = layer(x)
    assert got.dtype == BF16 and got.shape == (rows, 960)
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=2**-6)
    out = torch.randn(rows, 960).to(BF16)
    base = out.float()
    assert layer.forward_add_(out, x) is out
    torch.testing.assert_close(out.float(), base + want, atol=0.1, rtol=2**-6)


@needs_bf16_hardware
@pytest.mark.parametrize("fused", [None, "own", "onednn"])
def test_bf16_fast_path_model_is_as_close_to_fp32_as_plain_bf16(
    tiny_loaded, cpu_ops, fused, monkeypatch
):
    """Packed bf16 linears + the bf16 C++ layer ops + C++ attention (``fused``: all layers in the
    C++ decoder op, residual stream in fp32, on the own GEMM's bf16 panels or on oneDNN's packed
    bf16 weights, chosen with PAGEDLLM_BF16_GEMM so that AMX CPUs run both), against the plain
    ATen bf16 model, both measured against the fp32 model: the fast path's logit error is at most
    1.5x the plain one's (it rounds less often, so it is usually smaller), over an 8-token prefill
    and a decode on a shuffled block table."""
    if fused:
        monkeypatch.setenv("PAGEDLLM_BF16_GEMM", fused)
    from pagedllm.attention import get_attention_backend
    from pagedllm.model.llama import LlamaForCausalLM
    from pagedllm.worker.cache_engine import CacheEngine

    cfg = tiny_loaded.config
    fast = LlamaForCausalLM(cfg, BF16, get_attention_backend("cpu"), 64)
    plain = LlamaForCausalLM(cfg, BF16, get_attention_backend("torch_native"), 64)
    ref = LlamaForCausalLM(cfg, torch.float32, get_attention_backend("torch_native"), 64)
    for m in (fast, plain, ref):
        m.load_weights(tiny_loaded.state_dict)
    assert fast.pack_linears(cpu_ops) > 0
    fast.use_cpu_layer_ops(cpu_ops)
    if fused:
        if fused == "own" and cpu_gemm_ops(cpu_ops, BF16) is None:
            pytest.skip("the own GEMM's bf16 panels need the avx512 variant and avx512_bf16")
        assert fast.use_fused_layers(cpu_ops) == cfg.num_hidden_layers
        kinds = set(fast.fused_stack.layer_args[3])
        assert kinds == ({KIND_ONEDNN} if fused == "onednn" else {KIND_GEMM, KIND_SWIGLU})
    assert isinstance(fast.layers[0].mlp.down_proj, PackedLinear)
    assert fast.layers[0].input_layernorm.cpu_ops is not None
    caches = [CacheEngine(cfg, 8, 4, dt).kv_caches for dt in (BF16, BF16, torch.float32)]
    ids = torch.randint(0, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(1))
    got, base, want = _prefill_then_decode([fast, plain, ref], caches, [2, 7, 5], ids)
    for g, b, w in zip(got, base, want, strict=True):
        fast_err = (g.float() - w).abs().max().item()
        plain_err = (b.float() - w).abs().max().item()
        assert fast_err <= 1.5 * plain_err + 1e-3, (fast_err, plain_err)
