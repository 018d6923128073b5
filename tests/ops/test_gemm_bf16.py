"""The own GEMM on bf16 panels (``csrc/cpu/gemm.cpp``, the avx512 kernel variant on a CPU with
AVX512-BF16): x rounded to bf16 (ties to even), products of bf16 pairs summed in fp32, by
vdpbf16ps or by fp32 FMAs on the panels widened in registers (``CpuOps.gemm_bf16_fma``, the
default on Intel CPUs); each test runs both loops.

The reference is fp32 arithmetic on the bf16-rounded operands, so the only difference is the
order of the fp32 sums. Shapes cover every panel grouping of the driver (4, 2 and 1 full panels,
a partial last panel), one tile of up to 6 rows and balanced 6-12-row tiles from 7 rows on,
partial tiles, odd K (a zero-padded pair) and the three epilogues (store, accumulate into out,
SwiGLU), at 1 and 2 threads.

On CPUs with AMX the same panels also run on AMX tiles (``csrc/cpu/gemm_amx.cpp``, TDPBF16PS,
for K a multiple of 32): each test runs with the tiles off and on (``CpuOps.gemm_amx``), and the
AMX shapes add row counts across 16-row tiles, 32-row blocks and the row blocks of prefill, and
from 192 rows per thread the row split (each thread its own rows, the panels in L2-sized groups:
shapes across several groups and a partial last group)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from pagedllm.model.packed_linear import PackedLinear, PackedSwiGLU, cpu_gemm_ops
from pagedllm.platform import cpu_flags

BF16 = torch.bfloat16


@pytest.fixture(params=["vdpbf16ps", "fma", "amx"])
def bf16_ops(cpu_ops, request):
    """The C++ ops with the bf16 panels on one kernel (the param): vdpbf16ps, fp32 FMAs on
    widened panels, or AMX tiles (where K allows them; other K on the CPU's default loop); the
    process's settings restored after."""
    with bf16_ops_on(cpu_ops, request.param) as ops:
        yield ops


@contextlib.contextmanager
def bf16_ops_on(cpu_ops, kernel):
    """Skips unless bf16 panels can run ``kernel`` here; the ops with it on, the process's
    settings restored after."""
    if not cpu_flags().avx512_bf16:
        pytest.skip("bf16 GEMM panels need a CPU with avx512_bf16 (not in /proc/cpuinfo)")
    if cpu_ops.simd_level() != "avx512" or not cpu_ops.gemm_bf16_supported():
        pytest.skip(
            f"bf16 GEMM panels need the avx512 kernel variant; this runs {cpu_ops.variant!r}"
        )
    amx = kernel == "amx"
    if amx and not (cpu_flags().amx_bf16 and cpu_ops.gemm_amx()):
        pytest.skip("AMX GEMM tiles need a CPU with amx_bf16 and amx_tile (not in /proc/cpuinfo)")
    was_amx, was_fma = cpu_ops.gemm_amx(), cpu_ops.gemm_bf16_fma()
    cpu_ops.gemm_amx(amx)
    if not amx:
        assert cpu_ops.gemm_bf16_fma(kernel == "fma") == (kernel == "fma")
    try:
        yield cpu_ops
    finally:
        cpu_ops.gemm_amx(was_amx)
        cpu_ops.gemm_bf16_fma(was_fma)


def _want(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.to(BF16).double() @ w.double().T


def _close(got: torch.Tensor, want: torch.Tensor, k: int) -> None:
    # fp32 sums of k exact products in another order: |error| <= ~k * eps * sum |terms|.
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-6 * k, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 16, 2), (1, 40, 24), (5, 64, 33), (6, 100, 64), (7, 129, 1), (10, 200, 576),
     (12, 72, 63), (13, 256, 96), (25, 200, 576), (64, 144, 31), (97, 512, 130),
     (16, 48, 32), (17, 33, 64), (33, 80, 128), (48, 32, 32), (64, 576, 576), (500, 72, 576),
     (400, 1000, 576), (390, 24, 1536)],
)  # fmt: skip
def test_bf16_panels_equal_fp32_arithmetic(bf16_ops, m, n, k, threads):
    ops = bf16_ops
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(m * 1000 + n + k)
        w = torch.randn(n, k, generator=g).to(BF16)
        x = torch.randn(m, k, generator=g)
        packed = ops.gemm_pack_weight(w)
        assert packed.dtype == BF16 and packed.shape == ((n + 15) // 16, (k + 1) // 2, 32)
        want = _want(x, w)
        _close(ops.gemm_linear(x, packed, n), want, k)
        out = torch.randn(m, n, generator=g)
        base = out.double()
        ops.gemm_linear_add_(out, x, packed)
        _close(out, base + want, k)
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize(
    ("m", "inter", "k"),
    [(1, 8, 16), (7, 64, 45), (30, 136, 64), (40, 24, 96), (3, 64, 1536), (450, 264, 576),
     (5, 40, 64), (16, 48, 64), (33, 56, 96), (130, 72, 128)],
)
def test_bf16_swiglu_epilogue(bf16_ops, m, inter, k):
    g = torch.Generator().manual_seed(inter)
    w = torch.randn(2 * inter, k, generator=g).to(BF16)
    x = torch.randn(m, k, generator=g)
    got = bf16_ops.gemm_swiglu(x, bf16_ops.gemm_pack_swiglu_weight(w))
    gu = _want(x, w).float()
    want = F.silu(gu[:, :inter]) * gu[:, inter:]
    torch.testing.assert_close(got, want, atol=1e-4 * k, rtol=1e-4)


def test_a_row_gets_the_same_bits_in_any_batch(bf16_ops):
    """Rows are independent: a row's output is the same float alone, in a tile of up to 6 rows,
    a balanced tile of 6-12 rows (8 and 16 rows: tiles of 8) or a 450-row batch, for a store and for the accumulate (residual
    add) epilogue, whose AMX tiles start from the residual in whole and edge tiles alike (what
    lets decode, prefill and speculation agree bit for bit). On AMX the 450 and 400 rows run on
    the row split of prefill sizes (each thread its own rows, every panel), the others on the
    panel split of decode sizes (33-80 rows with 3 x 2 blocks for their first three row tiles,
    the third partial at 40 and 47 rows)."""
    g = torch.Generator().manual_seed(3)
    k = 192 if bf16_ops.gemm_amx() else 200  # the AMX tiles take K in steps of 32
    w = torch.randn(136, k, generator=g).to(BF16)
    x = torch.randn(450, k, generator=g)
    packed = bf16_ops.gemm_pack_weight(w)
    whole = bf16_ops.gemm_linear(x, packed, 136)
    base = torch.randn(450, 136, generator=g)  # the residual the accumulate epilogue adds to
    whole_add = base.clone()
    bf16_ops.gemm_linear_add_(whole_add, x, packed)
    for rows in ([0], [5], [11], list(range(0, 6)), list(range(3, 12)), list(range(12, 24)),
                 list(range(90, 100)), list(range(100, 108)), list(range(20, 36)),
                 list(range(10, 50)), list(range(3, 50)),
                 list(range(0, 48)), list(range(0, 64)), list(range(0, 80)),
                 list(range(41, 441))):
        part = bf16_ops.gemm_linear(x[rows].contiguous(), packed, 136)
        assert torch.equal(part, whole[rows]), rows
        part_add = base[rows].clone()
        bf16_ops.gemm_linear_add_(part_add, x[rows].contiguous(), packed)
        assert torch.equal(part_add, whole_add[rows]), rows


def test_x_is_rounded_to_nearest_even(bf16_ops):
    """x values halfway between two bf16 numbers round to the even one, as torch's .to(bf16)."""
    w = torch.zeros(16, 32, dtype=BF16)  # K = 32: one AMX tile wide
    w[0, 0] = 1.0
    halfway = torch.zeros(2, 32)
    halfway[:, 0] = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8])  # ties: 1.0, 1 + 2**-6
    got = bf16_ops.gemm_linear(halfway, bf16_ops.gemm_pack_weight(w), 16)[:, 0]
    assert got.tolist() == halfway[:, 0].to(BF16).float().tolist() == [1.0, 1.0 + 2**-6]


def test_bad_shapes_are_errors(bf16_ops):
    packed = bf16_ops.gemm_pack_weight(torch.randn(32, 10).to(BF16))
    with pytest.raises(RuntimeError, match="columns"):
        bf16_ops.gemm_linear(torch.randn(2, 12), packed, 32)
    with pytest.raises(RuntimeError, match="float32"):
        bf16_ops.gemm_linear(torch.randn(2, 10).to(BF16), packed, 32)


def test_bf16_packed_modules_take_bf16_and_fp32_rows(bf16_ops, monkeypatch):
    """PackedLinear / PackedSwiGLU on bf16 weights run the own GEMM and return x's dtype (on AMX
    CPUs too when PAGEDLLM_BF16_GEMM=own asks for it)."""
    monkeypatch.setenv("PAGEDLLM_BF16_GEMM", "own")
    assert cpu_gemm_ops(bf16_ops, BF16) is bf16_ops
    g = torch.Generator().manual_seed(9)
    w, b = torch.randn(48, 40, generator=g).to(BF16), torch.randn(48, generator=g).to(BF16)
    layer = PackedLinear(w, bf16_ops, b)
    assert layer.kernel == "pagedllm"
    x = torch.randn(3, 5, 40, generator=g)
    want = _want(x.reshape(15, 40), w).float() + b.float()
    got32 = layer(x)
    assert got32.dtype == torch.float32 and got32.shape == (3, 5, 48)
    torch.testing.assert_close(got32.reshape(15, 48), want, atol=1e-4, rtol=1e-5)
    got16 = layer(x.to(BF16))
    assert got16.dtype == BF16
    torch.testing.assert_close(
        got16.float(),
        _want(x.to(BF16), w).float().reshape(3, 5, 48) + b.float(),
        atol=0.05,
        rtol=2**-7,
    )
    out = torch.randn(15, 48, generator=g).to(BF16)
    base = out.float()
    assert layer.forward_add_(out, x.reshape(15, 40).to(BF16)) is out
    torch.testing.assert_close(out.float(), base + want, atol=0.1, rtol=2**-6)
    swiglu = PackedSwiGLU(torch.randn(32, 40, generator=g).to(BF16), bf16_ops)
    assert swiglu(x.reshape(15, 40).to(BF16)).dtype == BF16


def test_bf16_lm_head_logits_are_the_gemms_float32_sums(bf16_ops, monkeypatch):
    """A bf16 model's LM head on the own GEMM hands the sampler its float32 sums, not logits
    rounded to bf16 and converted back."""
    from pagedllm.model.layers.logits import lm_head_logits

    monkeypatch.setenv("PAGEDLLM_BF16_GEMM", "own")
    g = torch.Generator().manual_seed(11)
    w = torch.randn(300, 64, generator=g).to(BF16)
    head = PackedLinear(w, bf16_ops)
    h = torch.randn(5, 64, generator=g).to(BF16)  # the final norm's bf16 output
    logits = lm_head_logits(h, w, head, None, 300)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, bf16_ops.gemm_linear(h.float(), head.packed, 300))
    assert not torch.equal(logits, logits.to(BF16).float())  # not rounded to bf16
    _close(logits, _want(h.float(), w), 64)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 33), (5, 64, 576), (12, 100, 64), (70, 48, 130)])
def test_fma_loop_is_the_fp32_gemm_on_the_rounded_operands(cpu_ops, m, n, k):
    """The FMA loop widens each bf16 pair in registers and adds the products in k order, as the
    fp32 kernel does: its outputs equal the fp32 GEMM's on the bf16-rounded x and weights bit
    for bit (store, residual add and SwiGLU epilogues), at decode and prefill row counts."""
    with bf16_ops_on(cpu_ops, "fma") as ops:
        _check_fma_loop(ops, m, n, k)


def _check_fma_loop(bf16_ops, m, n, k):
    g = torch.Generator().manual_seed(m + n + k)
    w = torch.randn(n, k, generator=g).to(BF16)
    x = torch.randn(m, k, generator=g)
    xr, wf = x.to(BF16).float(), w.float()
    got = bf16_ops.gemm_linear(x, bf16_ops.gemm_pack_weight(w), n)
    assert torch.equal(got, bf16_ops.gemm_linear(xr, bf16_ops.gemm_pack_weight(wf), n))
    base = torch.randn(m, n, generator=g)
    got_add, want_add = base.clone(), base.clone()
    bf16_ops.gemm_linear_add_(got_add, x, bf16_ops.gemm_pack_weight(w))
    bf16_ops.gemm_linear_add_(want_add, xr, bf16_ops.gemm_pack_weight(wf))
    assert torch.equal(got_add, want_add)
    gu = torch.randn(2 * 16, k, generator=g).to(BF16)
    assert torch.equal(
        bf16_ops.gemm_swiglu(x, bf16_ops.gemm_pack_swiglu_weight(gu)),
        bf16_ops.gemm_swiglu(xr, bf16_ops.gemm_pack_swiglu_weight(gu.float())),
    )


def test_fp32_fmas_are_the_default_on_intel_cpus(cpu_ops):
    """Where vdpbf16ps is slow (Intel CPUs: half an FMA's multiply-adds per second on a Xeon
    without AMX), the bf16 panels run on fp32 FMAs and the attention keeps fp32 arithmetic
    unless AMX tiles run its products; AMD CPUs keep vdpbf16ps for both."""
    with bf16_ops_on(cpu_ops, "vdpbf16ps"):
        pass  # skips where bf16 panels cannot run; restores the process's settings
    with open("/proc/cpuinfo") as f:
        intel = any(
            line.split(":")[-1].strip() == "GenuineIntel"
            for line in f
            if line.startswith("vendor_id")
        )
    assert cpu_ops.gemm_bf16_fma() == intel
    assert cpu_ops.attention_bf16_dot() == (not intel or cpu_flags().amx_bf16)
