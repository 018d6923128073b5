"""The fast CPU step: packed linears (pagedllm's own AVX2 GEMM or oneDNN), fused C++ RMSNorm / SwiGLU / rotary kernels, the
sampler's fused argmax + logsumexp, and the whole model on that path equal to the plain ATen
model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.packed_linear import (
    PackedLinear,
    PackedSwiGLU,
    bf16_tiles,
    cpu_gemm_ops,
    onednn_linear_available,
    pack_linear_layers,
)

pytestmark = pytest.mark.skipif(  # the oneDNN ops come with every x86 PyTorch build
    not onednn_linear_available(torch.float32), reason="PyTorch built without MKL-DNN"
)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("shape", [(96, 64), (576, 960), (33, 17)])
def test_packed_linear_matches_f_linear(rows, shape):
    torch.manual_seed(rows)
    in_f, out_f = shape
    w = torch.randn(out_f, in_f)
    x = torch.randn(rows, in_f)
    got = PackedLinear(w)(x)
    assert got.shape == (rows, out_f) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-4, rtol=1e-5)


def test_pack_linear_layers_replaces_plain_linears_with_their_bias():
    class Sub(nn.Linear):
        pass

    m = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8), Sub(8, 8, bias=False))
    ref_w, ref_b = m[1].weight.clone(), m[1].bias.clone()
    assert pack_linear_layers(m) == 2
    assert isinstance(m[0], PackedLinear) and isinstance(m[1], PackedLinear)
    assert type(m[2]) is Sub  # subclasses may communicate (row-parallel): left alone
    x = torch.randn(3, 8)
    torch.testing.assert_close(m[1](x), F.linear(x, ref_w, ref_b), atol=1e-5, rtol=1e-5)
    out = torch.randn(3, 8)
    want = out + F.linear(x, ref_w, ref_b)
    torch.testing.assert_close(m[1].forward_add_(out, x), want, atol=1e-5, rtol=1e-5)


def test_packed_linear_bias_on_own_gemm(cpu_ops):
    torch.manual_seed(0)
    w, b, x = torch.randn(48, 32), torch.randn(48), torch.randn(5, 32)
    lin = PackedLinear(w, cpu_ops, b)
    torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    out = torch.randn(5, 48)
    want = out + F.linear(x, w, b)
    torch.testing.assert_close(lin.forward_add_(out, x), want, atol=1e-4, rtol=1e-5)


def test_worker_model_is_packed_and_matches_unpacked(tiny_loaded):
    from pagedllm.attention import get_attention_backend
    from pagedllm.model.llama import LlamaForCausalLM
    from pagedllm.worker.worker import Worker

    cfg = tiny_loaded.config
    worker = Worker(cfg, tiny_loaded.state_dict, torch.float32, 8, 4, 64, "torch_native")
    packed = worker.model
    assert isinstance(packed.layers[0].mlp.gate_up_proj, PackedLinear)
    assert packed.lm_head_packed is not None
    plain = LlamaForCausalLM(cfg, torch.float32, get_attention_backend("torch_native"), 64)
    plain.load_weights(tiny_loaded.state_dict)
    x = torch.randn(5, cfg.hidden_size)
    down_in = torch.randn(5, cfg.intermediate_size)
    torch.testing.assert_close(
        packed.layers[1].mlp.down_proj(down_in),
        plain.layers[1].mlp.down_proj(down_in),
        atol=1e-5,
        rtol=1e-5,
    )
    torch.testing.assert_close(
        packed.lm_head_packed(x), F.linear(x, plain.lm_head_weight), atol=1e-4, rtol=1e-5
    )



def test_fused_layer_ops_match_aten(cpu_ops):
    ops = cpu_ops
    torch.manual_seed(0)
    for t, d in ((1, 576), (64, 576), (7, 13), (300, 1536)):
        x, w, r = torch.randn(t, d), torch.randn(d), torch.randn(t, d)
        out = torch.empty_like(x)
        ops.rms_norm(out, x, w, 1e-5)
        torch.testing.assert_close(
            out, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w, atol=1e-5, rtol=1e-5
        )
        x2, r2 = x.clone(), r.clone()
        ops.fused_add_rms_norm(x2, r2, w, 1e-5)
        h = r + x
        torch.testing.assert_close(r2, h, atol=0, rtol=0)
        torch.testing.assert_close(
            x2, h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * w, atol=1e-5, rtol=1e-5
        )
        gu = torch.randn(t, 2 * d) * 4
        act = torch.empty(t, d)
        ops.silu_and_mul(act, gu)
        torch.testing.assert_close(act, F.silu(gu[:, :d]) * gu[:, d:], atol=1e-5, rtol=1e-5)
    half = torch.ones(2, 4, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.rms_norm(torch.empty_like(half), half, torch.ones(4, dtype=torch.float16), 1e-5)
    bf = torch.ones(2, 4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="weight must be contiguous and of x's dtype"):
        ops.rms_norm(torch.empty_like(bf), bf, torch.ones(4), 1e-5)


def test_fast_path_model_matches_plain_model(tiny_loaded, cpu_ops):
    """The whole forward with packed linears + fused C++ layer ops + C++ attention equals the
    plain ATen model with torch_native attention (fp32, 1e-4): an 8-token prefill, then a
    decode, over a shuffled block table [2, 7, 5] with block size 4."""
    from pagedllm.attention import get_attention_backend
    from pagedllm.model.llama import LlamaForCausalLM
    from pagedllm.worker.cache_engine import CacheEngine

    cfg = tiny_loaded.config
    fast = LlamaForCausalLM(cfg, torch.float32, get_attention_backend("cpu"), 64)
    plain = LlamaForCausalLM(cfg, torch.float32, get_attention_backend("torch_native"), 64)
    for m in (fast, plain):
        m.load_weights(tiny_loaded.state_dict)
    fast.pack_linears(cpu_ops)
    fast.use_cpu_layer_ops(cpu_ops)
    assert isinstance(fast.layers[0].mlp.down_proj, PackedLinear)
    own = cpu_gemm_ops(cpu_ops, torch.float32) is not None
    assert fast.layers[0].mlp.down_proj.kernel == ("pagedllm" if own else "onednn")
    gate_up = fast.layers[0].mlp.gate_up_proj
    assert isinstance(gate_up, PackedSwiGLU if own else PackedLinear)
    caches = [CacheEngine(cfg, 8, 4, torch.float32).kv_caches for _ in range(2)]
    table = [2, 7, 5]
    ids = torch.randint(0, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(1))

    for got, want in zip(*_prefill_then_decode([fast, plain], caches, table, ids), strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _one_sequence_meta(table: list[int], q_len: int, ctx: int):
    """Attention metadata of one sequence over block table ``table`` (block size 4) whose last
    ``q_len`` of ``ctx`` tokens are new."""
    from pagedllm.attention import AttentionMetadata

    slots = [table[p // 4] * 4 + p % 4 for p in range(ctx - q_len, ctx)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([table]),
        seq_lens=torch.tensor([ctx]),
        query_start_loc=torch.tensor([0, q_len]),
        seq_lens_list=[ctx],
        query_lens_list=[q_len],
        query_start_loc_list=[0, q_len],
        num_decodes=int(q_len == 1),
        block_size=4,
    )


def _prefill_then_decode(models, caches, table, ids):
    """Each model's logits of an 8-token prefill of ``ids[:8]`` and then a decode of ``ids[8]``
    (one list of two [T, V] tensors per model), each model on its own caches."""
    outs = []
    for model, kv in zip(models, caches, strict=True):
        got = []
        for q_ids, start in ((ids[:8], 0), (ids[8:9], 8)):
            pos = torch.arange(start, start + len(q_ids))
            meta = _one_sequence_meta(table, len(q_ids), start + len(q_ids))
            got.append(model(q_ids, pos, kv, meta, torch.arange(len(q_ids))))
        outs.append(got)
    return outs


def test_rotary_kernel_matches_aten_in_place_on_a_strided_view(cpu_ops):
    """The C++ rotary embedding rotates the Q and K heads of a fused [T, (H + 2 KVH) D] buffer in
    place (a strided view), equal to ``apply_rotary``; the V columns are left untouched."""
    from pagedllm.model.llama import apply_rotary

    ops = cpu_ops
    torch.manual_seed(0)
    for t, heads, d, v_heads in ((1, 12, 64, 3), (37, 12, 64, 3), (5, 3, 6, 1), (300, 2, 128, 1)):
        p_max = 100
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        freqs = torch.outer(torch.arange(p_max).float(), inv)
        cos, sin = freqs.cos(), freqs.sin()
        qkv = torch.randn(t, (heads + v_heads) * d)
        pos = torch.randint(0, p_max, (t,))
        pos[0] = p_max - 1
        x = qkv[:, : heads * d].view(t, heads, d)
        want = apply_rotary(x.clone(), cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))
        v_before = qkv[:, heads * d :].clone()
        ops.rotary_embedding(x, pos, cos, sin)
        torch.testing.assert_close(x, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(qkv[:, heads * d :], v_before)
    with pytest.raises(RuntimeError, match="outside the RoPE table"):
        ops.rotary_embedding(
            torch.zeros(1, 1, 4), torch.tensor([7]), torch.ones(7, 2), torch.ones(7, 2)
        )


def test_argmax_logsumexp_matches_aten(cpu_ops):
    """One fused pass per row = torch.argmax (first index on ties) and torch.logsumexp, for
    vocabulary sizes that are and are not a multiple of the vector width, with -inf entries and
    maxima at and across vector-lane boundaries and in the tail past the last whole vector."""
    ops = cpu_ops
    torch.manual_seed(0)
    for b, v in ((1, 1), (3, 7), (64, 49152), (5, 49157)):
        logits = torch.randn(b, v) * 5
        if v > 3:
            logits[:, 1] = float("-inf")
            logits[0, 2] = logits[0, 3] = logits[0].max() + 1.0  # a tie: the first index wins
        if b >= 4:  # the maximum found by vector compares: across a lane boundary, in the tail
            logits[1, 15] = logits[1, 16] = logits[1].max() + 1.0
            logits[2, v - 1] = logits[2].max() + 1.0
            logits[3, v - 20] = logits[3, v - 1] = logits[3].max() + 1.0
        idx, lse = ops.argmax_logsumexp(logits)
        assert idx.tolist() == logits.argmax(-1).tolist()
        torch.testing.assert_close(lse, torch.logsumexp(logits, -1), atol=1e-5, rtol=1e-6)
    wide = torch.randn(4, 64)[:, :50]  # a row stride that is not the width
    idx, lse = ops.argmax_logsumexp(wide)
    assert idx.tolist() == wide.argmax(-1).tolist()
    torch.testing.assert_close(lse, torch.logsumexp(wide, -1), atol=1e-5, rtol=1e-6)


def test_sampler_with_fused_ops_equals_aten_sampler(cpu_ops):
    """Sampler(cpu_ops=...) picks the same tokens with the same logprobs as the ATen sampler over
    greedy, seeded random, logit-bias and logprob rows."""
    from pagedllm.sampling.sampler import Sampler, SamplingBatch
    from pagedllm.sampling_params import SamplingParams

    torch.manual_seed(1)
    vocab = 1000
    logits = torch.randn(6, vocab) * 3
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=0.0, logit_bias={5: 100.0}),
        SamplingParams(temperature=1.0, top_k=20),
        SamplingParams(temperature=0.0),
    ]
    batch = SamplingBatch(
        params=params,
        seeds=[11, 12, 13, 14, 15, 16],
        output_token_ids=[[1, 2]] * 6,
        prompt_token_ids=[[3]] * 6,
        eos_token_ids=[0],
    )
    fused = Sampler(vocab, cpu_ops=cpu_ops)(logits, batch)
    plain = Sampler(vocab)(logits, batch)
    assert fused.sampled_token_ids == plain.sampled_token_ids
    assert fused.sampled_token_ids[3] == 5
    assert fused.sampled_ranks == plain.sampled_ranks
    torch.testing.assert_close(
        torch.tensor(fused.sampled_logprobs),
        torch.tensor(plain.sampled_logprobs),
        atol=1e-5,
        rtol=0,
    )
    assert fused.top_logprobs[1] is not None and plain.top_logprobs[1] is not None
    assert [t for t, _ in fused.top_logprobs[1]] == [t for t, _ in plain.top_logprobs[1]]


@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 64, 301])
@pytest.mark.parametrize("shape", [(576, 960), (17, 33), (1, 16), (1536, 5)])
def test_own_gemm_matches_f_linear(cpu_ops, rows, shape):
    """gemm_linear over packed panels = F.linear (fp32, 1e-4) for row counts around the 6-row
    tile, widths that are not a multiple of the 16-column panel, K = 1, and an x whose row
    stride is larger than its width."""
    ops = cpu_ops
    torch.manual_seed(rows)
    in_f, out_f = shape
    w = torch.randn(out_f, in_f)
    packed = ops.gemm_pack_weight(w)
    assert packed.shape == ((out_f + 15) // 16, in_f, 16)
    assert torch.equal(packed[0, :, : min(out_f, 16)], w[:16].t())  # panel 0 holds rows 0-15
    x = torch.randn(rows, in_f + 3)[:, :in_f]
    got = ops.gemm_linear(x, packed, out_f)
    assert got.shape == (rows, out_f) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-4, rtol=1e-4)


def test_own_gemm_rows_do_not_depend_on_the_batch(cpu_ops):
    """Each output row is bit-identical whether it is computed alone or inside 7-, 64- or
    301-row calls (one k order per row in every tile and thread split), over a width with a
    partial last panel: batch composition never changes a sequence's logits."""
    ops = cpu_ops
    torch.manual_seed(0)
    w = torch.randn(200, 576)
    packed = ops.gemm_pack_weight(w)
    x = torch.randn(301, 576)
    alone = torch.cat([ops.gemm_linear(x[i : i + 1], packed, 200) for i in range(301)])
    for rows in (7, 64, 301):
        assert torch.equal(ops.gemm_linear(x[:rows], packed, 200), alone[:rows]), rows


@pytest.mark.parametrize("rows", [0, 1, 6, 7, 64])
def test_own_gemm_epilogues(cpu_ops, rows):
    """The accumulate epilogue (out += x W^T in place, also into a strided out and a width that
    is not a multiple of 16) and the SwiGLU epilogue (silu(gate) * up from the interleaved
    panels) equal their ATen compositions."""
    ops = cpu_ops
    torch.manual_seed(rows)
    for in_f, out_f in ((1536, 576), (24, 40)):
        w = torch.randn(out_f, in_f) * 0.1
        x = torch.randn(rows, in_f)
        base = torch.randn(rows, out_f + 5)
        out = base.clone()[:, :out_f]
        ops.gemm_linear_add_(out, x, ops.gemm_pack_weight(w))
        torch.testing.assert_close(out, base[:, :out_f] + F.linear(x, w), atol=1e-4, rtol=1e-4)
    for in_f, inter in ((576, 1536), (16, 8), (5, 24)):
        w = torch.randn(2 * inter, in_f) * 0.3
        x = torch.randn(rows, in_f)
        gate, up = F.linear(x, w).split(inter, dim=-1)
        got = PackedSwiGLU(w, ops)(x)
        assert got.shape == (rows, inter)
        torch.testing.assert_close(got, F.silu(gate) * up, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="weight"):
        PackedSwiGLU(torch.randn(20, 4), ops)


def test_own_gemm_rejects_bad_input(cpu_ops):
    ops = cpu_ops
    packed = ops.gemm_pack_weight(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="float32"):
        ops.gemm_linear(torch.randn(2, 8, dtype=torch.float64), packed, 20)
    with pytest.raises(RuntimeError, match="columns"):
        ops.gemm_linear(torch.randn(2, 9), packed, 20)
    with pytest.raises(RuntimeError, match="out_features"):
        ops.gemm_linear(torch.randn(2, 8), packed, 40)
    with pytest.raises(RuntimeError, match="2-D float32"):
        ops.gemm_pack_weight(torch.randn(4))
    with pytest.raises(RuntimeError, match="out has 40 columns"):
        ops.gemm_linear_add_(torch.zeros(2, 40), torch.randn(2, 8), packed)
    misaligned = torch.zeros(2 * 8 * 16 + 1)[1:].view(2, 8, 16)  # 4 bytes past the allocation
    with pytest.raises(RuntimeError, match="aligned"):
        ops.gemm_linear(torch.randn(2, 8), misaligned, 20)
    shared = torch.randn(2, 40)
    with pytest.raises(RuntimeError, match="overlap"):
        ops.gemm_linear_add_(shared[:, 8:28], shared[:, :8], packed)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ops.gemm_pack_swiglu_weight(torch.randn(24, 8))


def test_packed_linear_kernel_choice(cpu_ops, monkeypatch):
    """The own GEMM runs fp32 when the extension is an AVX2 or AVX-512 build, bf16 only on the
    AVX-512 build with AVX512-BF16; PAGEDLLM_DISABLE_CPU_GEMM=1 or no extension give oneDNN;
    both give F.linear's values, also for a 3-D input."""
    ops = cpu_ops
    w, x = torch.randn(40, 24), torch.randn(2, 3, 24)
    own = PackedLinear(w, ops)
    assert own.kernel == ("pagedllm" if ops.simd_level() in ("avx2", "avx512") else "onednn")
    bf16_capable = ops.simd_level() == "avx512" and ops.gemm_bf16_supported()
    # PAGEDLLM_BF16_GEMM: auto is the own GEMM, oneDNN on AMX-BF16 CPUs only when the own GEMM
    # does not run the AMX tiles; own / onednn force the choice.
    amx_was = ops.gemm_amx()
    try:
        for amx in (True, False):
            ops.gemm_amx(amx)
            auto_own = not bf16_tiles() or ops.gemm_amx()
            for choice, own_expected in (("auto", auto_own), ("own", True), ("onednn", False)):
                monkeypatch.setenv("PAGEDLLM_BF16_GEMM", choice)
                got = cpu_gemm_ops(ops, torch.bfloat16) is ops
                assert got == (bf16_capable and own_expected), (amx, choice)
                assert cpu_gemm_ops(ops, torch.float32) is ops or ops.simd_level() == "scalar"
    finally:
        ops.gemm_amx(amx_was)
    monkeypatch.setenv("PAGEDLLM_BF16_GEMM", "amx")
    with pytest.raises(ValueError, match="PAGEDLLM_BF16_GEMM='amx'"):
        cpu_gemm_ops(ops, torch.bfloat16)
    monkeypatch.delenv("PAGEDLLM_BF16_GEMM")
    assert cpu_gemm_ops(None, torch.float32) is None
    monkeypatch.setenv("PAGEDLLM_DISABLE_CPU_GEMM", "1")
    onednn = PackedLinear(w, ops)
    assert onednn.kernel == "onednn"
    torch.testing.assert_close(own(x), F.linear(x, w), atol=1e-4, rtol=1e-4)
    for layer in (own, onednn):  # forward_add_: in place, the same tensor returned
        x2, base = torch.randn(5, 24), torch.randn(5, 40)
        out = base.clone()
        assert layer.forward_add_(out, x2) is out
        torch.testing.assert_close(out, base + F.linear(x2, w), atol=1e-4, rtol=1e-4)


def test_worker_with_cpu_backend_uses_own_gemm(tiny_loaded, cpu_ops):
    from pagedllm.worker.worker import Worker

    worker = Worker(tiny_loaded.config, tiny_loaded.state_dict, torch.float32, 8, 4, 64, "cpu")
    own = cpu_gemm_ops(cpu_ops, torch.float32) is not None
    assert worker.model.layers[0].self_attn.qkv_proj.kernel == ("pagedllm" if own else "onednn")
    assert worker.model.lm_head_packed is not None
    assert worker.model.lm_head_packed.kernel == ("pagedllm" if own else "onednn")
