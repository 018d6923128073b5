"""int8 W8A8 linears (``--quantization int8``): the C++ kernel equals the PyTorch reference of
the quantized math (``torch._int_mm``) over random shapes, stays within int8 tolerance of the
fp32 linear, and the whole model agrees with fp32 on most greedy tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.quant.int8 import (
    Int8Linear,
    int8_matmul,
    quantize_linear_layers,
    quantize_symmetric,
    split_outliers,
)
from pagedllm.platform import cpu_flags

SHAPES = [(64, 96), (33, 17), (1536, 576), (5, 1), (40, 130)]  # (out N, in K): K % 4 != 0 too


@pytest.fixture(scope="module")
def ops(cpu_ops):
    return cpu_ops


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The quantized math in float64 (exact integer sums), rounded to float32 at the end; the
    outliers (|x| > 6) times the int8 weights in float64."""
    inliers, outliers = split_outliers(x)
    qx, sx = quantize_symmetric(inliers)
    qw, sw = quantize_symmetric(w)
    acc = qx.double() @ qw.double().t()
    y = (acc.float() * sx.unsqueeze(1) * sw).double()
    y = y if b is None else y + b.double()
    return y + (outliers.double() @ qw.double().t()) * sw.double()


def _int_mm_reference(x, qw, sw, b):
    inliers, outliers = split_outliers(x)
    qx, sx = quantize_symmetric(inliers)
    return int8_matmul(qx, sx, qw, sw, b, outliers)


def test_quantize_symmetric_values():
    x = torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [-254.0, 127.0, 1.0, 0.5]])
    q, s = quantize_symmetric(x)
    assert q.tolist() == [[127, -64, 32, 0], [0, 0, 0, 0], [-127, 64, 0, 0]]  # half to even
    torch.testing.assert_close(s, torch.tensor([1 / 127, 0.0, 2.0]))


def test_cpp_quantize_rows_equals_torch(ops):
    torch.manual_seed(0)
    x = torch.randn(9, 70) * torch.logspace(-3, 3, 9).unsqueeze(1)
    x[3] = 0
    q, s = ops.int8_quantize_rows(x)
    rq, rs = quantize_symmetric(x)
    assert torch.equal(q, rq) and torch.equal(s, rs)


@pytest.mark.parametrize("rows", [0, 1, 4, 7, 64])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_int_mm_reference(ops, rows, shape, bias):
    torch.manual_seed(rows * 31 + shape[0])
    n, k = shape
    w, x = torch.randn(n, k), torch.randn(rows, k) * 3
    b = torch.randn(n) if bias else None
    lin = Int8Linear(w, b, ops)
    assert lin.kernel == f"pagedllm-{ops.int8_gemm_isa()}"
    got = lin(x)
    qw, sw = quantize_symmetric(w)
    # Same int32 sums and codes; the scale products may differ by an ulp, the
    # outliers' float sums (x * 3 has ~25 of them in a row of 576) in their last bits. One unit
    # off in an int32 sum would move y by s_x * s_w ~ 1e-3.
    torch.testing.assert_close(got, _int_mm_reference(x, qw, sw, b), rtol=2e-6, atol=1e-4)
    torch.testing.assert_close(got.double(), _reference(x, w, b), rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("shape", SHAPES)
def test_fallback_equals_kernel_and_fp32_within_int8_tolerance(ops, shape):
    torch.manual_seed(shape[1])
    n, k = shape
    w, x = torch.randn(n, k), torch.randn(7, k)
    fallback, kernel = Int8Linear(w), Int8Linear(w, None, ops)
    assert fallback.kernel == "torch._int_mm"
    torch.testing.assert_close(fallback(x), kernel(x), rtol=2e-6, atol=1e-5)
    # Per element: |error| <= (|x| s_w / 2 + |w| s_x / 2 + s_x s_w / 4) summed over k.
    _, sx = quantize_symmetric(x)
    _, sw = quantize_symmetric(w)
    bound = 0.5 * (x.abs() @ (sw.unsqueeze(1) * torch.ones_like(w)).t())
    bound += 0.5 * sx.unsqueeze(1) * (torch.ones_like(x) @ w.abs().t())
    bound += 0.25 * k * sx.unsqueeze(1) * sw
    err = (kernel(x) - F.linear(x, w)).abs()
    assert bool((err <= bound * 1.001 + 1e-6).all())
    assert err.max() < 0.05 * F.linear(x, w).abs().max()  # and small in practice


def test_outliers_are_computed_in_float(ops):
    """A row with one activation of 2000 (as SmolLM2's later down projections see): without the
    outlier decomposition its other elements quantize with a step of ~16, to zero; with it the
    row's activation error is as small as a row's without outliers (LLM.int8(), section 3.2).
    The error is measured against the int8 weights in float, so the weights' own rounding
    (which the outlier multiplies in either scheme) is left out."""
    torch.manual_seed(3)
    w, x = torch.randn(64, 576), torch.randn(4, 576)
    x[1, 5] = 2000.0
    x[2, 7] = -40.0
    got = Int8Linear(w, None, ops)(x)
    qw, sw = quantize_symmetric(w)
    exact = F.linear(x, qw.float() * sw.unsqueeze(1))
    qx, sx = quantize_symmetric(x)  # one scale over the whole row: the old scheme
    plain = int8_matmul(qx, sx, qw, sw)
    err, plain_err = (got - exact).abs().amax(1), (plain - exact).abs().amax(1)
    assert bool((err[1:3] * 10 < plain_err[1:3]).all()), (err, plain_err)
    assert bool((err[1:3] < 3 * err[[0, 3]].max()).all()), err  # as good as the plain rows
    # Rows without outliers are unchanged.
    torch.testing.assert_close(got[[0, 3]], plain[[0, 3]], rtol=2e-6, atol=1e-5)


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "inf", "6abc"])
def test_a_bad_outlier_threshold_is_refused_at_load(ops, monkeypatch, value):
    """Python (the fallback and the engine's start-up) raises a ValueError naming the
    variable, before any layer is replaced."""
    from pagedllm.model.quant.int8 import int8_outlier_threshold, quantize_model

    monkeypatch.setenv("PAGEDLLM_INT8_OUTLIER_THRESHOLD", value)
    with pytest.raises(ValueError, match="PAGEDLLM_INT8_OUTLIER_THRESHOLD"):
        int8_outlier_threshold()
    model = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(ValueError, match="PAGEDLLM_INT8_OUTLIER_THRESHOLD"):
        quantize_model(model, "int8", ops)
    assert type(model[0]) is nn.Linear


@pytest.mark.parametrize("value", ["abc", "6abc"])
def test_a_bad_outlier_threshold_is_refused_by_the_kernel(ops, monkeypatch, value):
    """The C++ kernel reads the variable once per process (a fresh one here) and refuses what
    Python refuses; it used to read "abc" as 0 and "6abc" as 6."""
    import subprocess
    import sys

    monkeypatch.setenv("PAGEDLLM_INT8_OUTLIER_THRESHOLD", value)
    code = (
        "import torch, pagedllm\n"
        "from pagedllm.ops import load_cpu_ops\n"
        "from pagedllm.model.quant.int8 import Int8Linear\n"
        "lin = Int8Linear(torch.randn(16, 8), None, load_cpu_ops())\n"
        "try:\n    lin(torch.randn(2, 8))\nexcept RuntimeError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600)
    assert "PAGEDLLM_INT8_OUTLIER_THRESHOLD must be a finite number" in out.stdout, out


@pytest.mark.parametrize("value,want", [("0", 0.0), (" 6 ", 6.0), ("2.5", 2.5), ("", 6.0)])
def test_outlier_threshold_values(monkeypatch, value, want):
    from pagedllm.model.quant.int8 import int8_outlier_threshold

    monkeypatch.setenv("PAGEDLLM_INT8_OUTLIER_THRESHOLD", value)
    assert int8_outlier_threshold() == want


@pytest.mark.parametrize("count", [31, 32, 33, 200])
def test_rows_with_many_outliers(ops, count):
    """The kernel lists 32 outliers per row and scans a row with more again: every count gives
    the reference's result, and a row's result does not depend on the rows beside it."""
    torch.manual_seed(count)
    w, x = torch.randn(40, 576), torch.randn(3, 576)
    x[1, torch.randperm(576)[:count]] = 20.0 * torch.randn(count).sign()
    lin = Int8Linear(w, None, ops)
    got = lin(x)
    qw, sw = quantize_symmetric(w)
    torch.testing.assert_close(got, _int_mm_reference(x, qw, sw, None), rtol=2e-6, atol=1e-3)
    assert torch.equal(lin(x[1:2]), got[1:2])


def test_leading_dims_and_bf16_input(ops):
    torch.manual_seed(1)
    w, x = torch.randn(24, 40), torch.randn(2, 3, 40)
    lin = Int8Linear(w, None, ops)
    y = lin(x)
    assert y.shape == (2, 3, 24)
    torch.testing.assert_close(y, lin(x.reshape(6, 40)).view(2, 3, 24), rtol=0.0, atol=0.0)
    assert lin(x.bfloat16()).dtype == torch.bfloat16


def test_saturation_free_at_the_int8_limits(ops):
    """|x| = |w| = 127 everywhere: the AVX2 maddubs pair sums reach 2 * 127 * 127 = 32258, just
    under int16's limit; the result must still be exact."""
    k = 1000
    w = torch.full((16, k), 1.0)
    w[1::2] = -1.0
    x = torch.ones(3, k)
    x[1] = -1
    got = Int8Linear(w, None, ops)(x)
    want = F.linear(x, w)  # +-1000: the int32 sum is exact, the scales round
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("shape", SHAPES)
def test_record_holds_the_layer_and_its_linear_is_bit_identical(ops, shape):
    torch.manual_seed(shape[0] + 7 * shape[1])
    n, k = shape
    w, x = torch.randn(n, k), torch.randn(6, k)
    b = torch.randn(n)
    lin = Int8Linear(w, b, ops)
    qw, sw = quantize_symmetric(w)
    # qweight, wscale and wsum are views of the one record the fused layers take.
    base = lin.record.untyped_storage().data_ptr()
    for t in (lin.qweight, lin.wscale, lin.wsum):
        assert t.untyped_storage().data_ptr() == base
    assert torch.equal(lin.wscale, sw) and torch.equal(lin.wsum[:n], qw.sum(1, dtype=torch.int32))
    assert lin.record.numel() == lin.qweight.numel() + 4 * n + 4 * lin.wsum.numel()
    assert torch.equal(ops.int8_linear_record(x, lin.record, n, b), lin(x))
    with pytest.raises(RuntimeError, match="does not match"):
        ops.int8_linear_record(torch.randn(2, k + 4), lin.record, n)


def test_kernel_rejects_bad_input(ops):
    lin = Int8Linear(torch.randn(16, 8), None, ops)
    with pytest.raises(RuntimeError, match="columns"):
        ops.int8_linear(torch.randn(2, 12), lin.qweight, lin.wscale, lin.wsum, None, 16)
    with pytest.raises(RuntimeError, match="float32"):
        ops.int8_linear(torch.randn(2, 8).double(), lin.qweight, lin.wscale, lin.wsum, None, 16)
    with pytest.raises(RuntimeError, match="out_features"):
        ops.int8_linear(torch.randn(2, 8), lin.qweight, lin.wscale, lin.wsum, None, 40)


def test_isa_paths_this_cpu_lacks_are_named():
    flags = cpu_flags()
    if not flags.avx512_vnni:
        pytest.skip("AVX512-VNNI path not tested here: the CPU lacks the avx512_vnni flag")
    from pagedllm.attention.cpu import load_cpu_ops

    ops = load_cpu_ops()
    assert ops is not None
    if ops.variant != "avx512":
        pytest.skip(f"AVX512-VNNI path: the {ops.variant} kernel variant was asked for "
                    "(PAGEDLLM_CPU_KERNEL_VARIANT), which is built without it")
    assert ops.int8_gemm_isa() == "avx512_vnni"


_ISA_PATH_CHECK = """
import sys
import torch
import pagedllm
from pagedllm.ops import load_cpu_ops
from pagedllm.model.quant.int8 import Int8Linear, int8_matmul, quantize_symmetric, split_outliers

ops = load_cpu_ops()
assert ops.int8_gemm_isa() == sys.argv[1], ops.int8_gemm_isa()
torch.manual_seed(0)
for n, k in [(40, 130), (33, 17), (96, 64), (5, 1)]:  # 3, 3, 6 and 1 panels of 16
    w, b = torch.randn(n, k), torch.randn(n)
    lin = Int8Linear(w, b, ops)
    qw, sw = quantize_symmetric(w)
    for rows in (1, 3, 4, 5, 8, 9, 13, 16, 17, 33):
        x = torch.randn(rows, k) * 3
        x[rows // 2, : min(k, 40)] = 30.0  # more outliers than the kernel lists per row
        got = lin(x)
        inliers, outliers = split_outliers(x)
        qx, sx = quantize_symmetric(inliers)
        want = int8_matmul(qx, sx, qw, sw, b, outliers)
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-4)
        for i in range(rows):  # a row's result does not depend on the rows beside it
            assert torch.equal(lin(x[i : i + 1]), got[i : i + 1]), (n, k, rows, i)
print("ok")
"""


@pytest.mark.parametrize("isa", ["amx_int8", "avx512_vnni", "avx_vnni", "avx2", "scalar"])
def test_each_isa_path_equals_the_reference_and_is_batch_invariant(ops, isa):
    """Every inner loop this CPU can run, forced in a fresh process (``PAGEDLLM_INT8_ISA``; the
    choice is made once per process), over row counts that cover whole and partial 8-row blocks
    (16-row blocks for the AMX tiles) and shapes with odd panel counts (the VNNI kernel and the
    AMX tiles take panels two at a time) and K across whole and partial 64-k tile rows."""
    import os
    import subprocess
    import sys

    flags = cpu_flags()
    if isa == "amx_int8" and not flags.amx_int8:
        pytest.skip("AMX-INT8 path: the CPU lacks the amx_int8 flag")
    if isa == "amx_int8" and ops.variant != "avx512":
        pytest.skip(f"AMX-INT8 path: the {ops.variant} kernel variant is built without AMX")
    if isa == "avx512_vnni" and not flags.avx512_vnni:
        pytest.skip("AVX512-VNNI path: the CPU lacks the avx512_vnni flag")
    if isa == "avx_vnni" and not flags.avx_vnni:
        pytest.skip("AVX-VNNI path: the CPU lacks the avx_vnni flag")
    if isa == "avx_vnni" and ops.int8_gemm_isa() == "scalar":
        pytest.skip("AVX-VNNI path: the scalar kernel variant has no SIMD loops")
    if isa == "avx2" and not flags.avx2:
        pytest.skip("AVX2 path: the CPU lacks the avx2 flag")
    if isa == "avx512_vnni" and ops.int8_gemm_isa() != "avx512_vnni":
        pytest.skip(f"AVX512-VNNI path: the {ops.variant} kernel variant runs "
                    f"{ops.int8_gemm_isa()}")
    env = {**os.environ, "PAGEDLLM_INT8_ISA": isa}
    out = subprocess.run([sys.executable, "-c", _ISA_PATH_CHECK, isa], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_amx_int8_tiles_are_opt_in(ops):
    """Not yet measured against AVX512-VNNI on an AMX Xeon, the AMX tiles run only when asked
    for: on every CPU the default loop is another one."""
    assert ops.int8_gemm_isa() != "amx_int8"


def test_quantize_linear_layers_replaces_plain_and_row_parallel():
    m = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 8))
    assert quantize_linear_layers(m) == 2
    assert all(isinstance(c, Int8Linear) for c in m)
    assert m[1].bias is not None and m(torch.randn(3, 8)).shape == (3, 8)


def _greedy(llm, prompts, n=12):
    from pagedllm.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_tiny_model_int8_agrees_with_fp32(tiny_llm_factory):
    """The next token after each of 24 random prompts (independent decisions: a random model's
    greedy continuations diverge for good after one flip)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in range(3, 27)]
    ref = _greedy(tiny_llm_factory(dtype="float32"), prompts, n=1)
    llm = tiny_llm_factory(dtype="float32", quantization="int8")
    layer = llm.engine.executor.worker.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj, Int8Linear)
    assert isinstance(layer.self_attn.o_proj, Int8Linear)
    got = _greedy(llm, prompts, n=1)
    same = sum(r == g for r, g in zip(ref, got))
    assert same >= 0.8 * len(prompts), (ref, got)


def test_int8_refused_off_cpu():
    from pagedllm.config import EngineConfig

    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int4")
