"""The C++ kernel loader (pagedllm.ops): dispatcher registration, per-variant builds and cache
keys, the fallbacks, and the variants other than this CPU's (slow: each compiles the kernels)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pagedllm.ops import loader
from pagedllm.platform import cpu_kernel_variant, missing_flags

OPS = (
    "paged_attention_decode", "paged_attention_prefill", "reshape_and_cache", "copy_blocks",
    "swap_blocks", "simd_level", "rms_norm", "fused_add_rms_norm", "silu_and_mul",
    "rotary_embedding", "gemm_pack_weight", "gemm_pack_swiglu_weight", "gemm_linear",
    "gemm_linear_add_", "gemm_swiglu", "argmax_logsumexp",
)  # fmt: skip
_LOADER_ENV = (
    "PAGEDLLM_DISABLE_CPU_KERNELS",
    "PAGEDLLM_CPU_KERNEL_VARIANT",
    "PAGEDLLM_CPU_ARCH_FLAGS",
    "CXX",
)



def test_ops_registered_with_the_dispatcher(cpu_ops) -> None:
    for name in OPS:
        assert hasattr(torch.ops.pagedllm, name), name
    schema = torch.ops.pagedllm.rms_norm.default._schema
    assert [a.name for a in schema.arguments] == ["out", "x", "weight", "eps"]
    out_arg = schema.arguments[0]
    assert out_arg.alias_info is not None and out_arg.alias_info.is_write
    for op in (torch.ops.pagedllm.paged_attention_decode, torch.ops.pagedllm.paged_attention_prefill):
        assert [(a.name, a.default_value) for a in op.default._schema.arguments[-3:]] == [
            ("partition_size", 512),
            ("window", 0),
            ("sinks", None),
        ]
    # Called straight through the dispatcher, no wrapper.
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, -1.0, 2.0]])
    arg, lse = torch.ops.pagedllm.argmax_logsumexp(logits)
    assert arg.tolist() == [1, 0]
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1))


def test_loaded_variant_matches_the_cpu(cpu_ops) -> None:
    build = loader.kernel_build()
    assert build is not None and build.variant == cpu_ops.variant
    if not os.environ.get("PAGEDLLM_CPU_ARCH_FLAGS"):
        assert cpu_ops.simd_level() == build.simd_level == build.variant
        assert "-march=native" not in build.cflags
    if os.environ.get("PAGEDLLM_CPU_KERNEL_VARIANT", "auto") == "auto":
        assert build.variant == cpu_kernel_variant()
    assert build.build_dir.name.startswith(f"pagedllm_cpu_{build.variant}_")
    assert build.library.is_file() and build.library.parent == build.build_dir
    # Compiled from the content-keyed copy of the sources, not from where they lie.
    ninja = (build.build_dir / "build.ninja").read_text()
    assert str(build.build_dir / loader.STAGED_SOURCES_DIR / "torch_bindings.cpp") in ninja
    assert str(loader.SRC_DIR) not in ninja
    assert str(build.build_dir).startswith(str(loader.cache_root())) or "pagedllm-" in str(
        build.build_dir
    )  # the preferred root, or the temporary fallback when it is not writable
    assert repr(cpu_ops) == f"CpuOps(variant={build.variant!r}, simd_level={build.simd_level!r})"


def test_variant_flags_are_explicit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDLLM_CPU_ARCH_FLAGS", raising=False)
    flags = loader.VARIANT_FLAGS
    assert set(flags) == {"avx512", "avx2", "scalar"}
    assert {"-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"} <= set(
        flags["avx512"]
    )
    assert {"-mavx2", "-mfma", "-mf16c"} <= set(flags["avx2"])
    assert not any(f.startswith("-mavx512") and "no" not in f for f in flags["avx2"])
    assert all("native" not in f for fs in flags.values() for f in fs)


def test_build_key_covers_variant_and_flags_not_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDLLM_CPU_ARCH_FLAGS", raising=False)
    keys = {v: loader.build_key(v) for v in ("avx512", "avx2", "scalar")}
    assert len(set(keys.values())) == 3
    assert loader.build_key("avx2") == keys["avx2"]  # deterministic
    monkeypatch.setenv("PAGEDLLM_CPU_ARCH_FLAGS", "-march=native")
    assert loader.isa_flags("avx2") == ("-march=native",)
    assert loader.build_key("avx2") != keys["avx2"]


def _copy_sources(dst: Path) -> Path:
    dst.mkdir(parents=True)
    for name in (*loader.SOURCES, *loader.HEADERS):
        (dst / name).write_bytes((loader.SRC_DIR / name).read_bytes())
    return dst


def test_build_key_covers_contents_not_the_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("PAGEDLLM_CPU_ARCH_FLAGS", raising=False)
    here = loader.build_key("avx2")
    elsewhere = _copy_sources(tmp_path / "other_checkout" / "csrc" / "cpu")
    monkeypatch.setattr(loader, "SRC_DIR", elsewhere)
    assert loader.build_key("avx2") == here  # a worktree or an installed wheel shares the build
    header = elsewhere / loader.HEADERS[0]
    header.write_bytes(header.read_bytes() + b"\n// changed\n")
    assert loader.build_key("avx2") != here  # headers count, not only the .cpp files
    edited = loader.build_key("avx2")
    # Another environment's torch (its headers' paths are in ninja's commands): its own build.
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "venv2" / "torch" / "__init__.py"))
    assert loader.build_key("avx2") != edited


def test_stage_sources_copies_once_and_repairs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    src = _copy_sources(tmp_path / "checkout")
    monkeypatch.setattr(loader, "SRC_DIR", src)
    build = tmp_path / "build"
    build.mkdir()
    staged = loader.stage_sources(build)
    assert staged == build / loader.STAGED_SOURCES_DIR
    names = (*loader.SOURCES, *loader.HEADERS)
    assert sorted(p.name for p in staged.iterdir()) == sorted(names)  # no partial files left
    for name in names:
        assert (staged / name).read_bytes() == (src / name).read_bytes()
    # Unchanged files keep their mtime (ninja would rebuild otherwise) ...
    old = {n: (staged / n).stat().st_mtime_ns for n in names}
    for name in names:
        os.utime(staged / name, ns=(old[name] - 10**9, old[name] - 10**9))
    before = {n: (staged / n).stat().st_mtime_ns for n in names}
    loader.stage_sources(build)
    assert {n: (staged / n).stat().st_mtime_ns for n in names} == before
    # ... and a damaged copy (say, truncated by a killed process) is rewritten.
    (staged / loader.SOURCES[0]).write_bytes(b"")
    loader.stage_sources(build)
    assert (staged / loader.SOURCES[0]).read_bytes() == (src / loader.SOURCES[0]).read_bytes()


_FAKE_CXX = """#!/bin/sh
# Records each call, then writes the object named after -o.
echo "$@" >> "$(dirname "$0")/calls.log"
while [ $# -gt 0 ]; do
  if [ "$1" = "-o" ]; then printf obj > "$2"; fi
  shift
done
"""


def test_compile_check_reuses_objects_of_the_same_sources(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cxx = tmp_path / "bin" / "fake-c++"
    cxx.parent.mkdir()
    cxx.write_text(_FAKE_CXX)
    cxx.chmod(0o755)
    calls = tmp_path / "bin" / "calls.log"
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.delenv("PAGEDLLM_CPU_ARCH_FLAGS", raising=False)
    monkeypatch.setattr(loader, "SRC_DIR", _copy_sources(tmp_path / "checkout"))
    out = tmp_path / "objects"
    first = loader.compile_check("avx512", out)
    assert len(first) == len(loader.SOURCES)
    assert len(calls.read_text().splitlines()) == len(loader.SOURCES)
    assert all("-mavx512f" in line and "-O0" in line for line in calls.read_text().splitlines())
    assert sorted(out.iterdir()) == sorted(first)  # no partial objects left
    assert loader.compile_check("avx512", out) == first  # nothing compiled again
    assert len(calls.read_text().splitlines()) == len(loader.SOURCES)
    # Different sources or flags: compiled anew, under other names.
    edited = loader.SRC_DIR / loader.SOURCES[0]
    edited.write_bytes(edited.read_bytes() + b"\n")
    second = loader.compile_check("avx512", out)
    assert set(second).isdisjoint(first)
    monkeypatch.setenv("PAGEDLLM_CPU_ARCH_FLAGS", "-mavx512f")
    assert set(loader.compile_check("avx512", out)).isdisjoint({*first, *second})
    assert len(calls.read_text().splitlines()) == 3 * len(loader.SOURCES)


def test_cache_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PAGEDLLM_KERNEL_CACHE_DIR", raising=False)
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "c"))
    assert loader.cache_root() == tmp_path / "c" / "torch_extensions"
    monkeypatch.delenv("PAGEDLLM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert loader.cache_root() == tmp_path / "xdg" / "pagedllm" / "torch_extensions"
    monkeypatch.setenv("PAGEDLLM_KERNEL_CACHE_DIR", str(tmp_path / "k"))
    assert loader.cache_root() == tmp_path / "k"
    d = loader.build_dir("scalar")
    assert d.parent == tmp_path / "k" and d.is_dir()
    # Not writable (a file where the root should be): the temporary fallback.
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("PAGEDLLM_KERNEL_CACHE_DIR", str(tmp_path / "file"))
    assert loader.build_dir("scalar").parent.name == "torch_extensions"
    assert "pagedllm-" in str(loader.build_dir("scalar"))


def test_requested_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDLLM_CPU_KERNEL_VARIANT", raising=False)
    assert loader.requested_variant() == cpu_kernel_variant()
    monkeypatch.setenv("PAGEDLLM_CPU_KERNEL_VARIANT", "Scalar")
    assert loader.requested_variant() == "scalar"
    monkeypatch.setenv("PAGEDLLM_CPU_KERNEL_VARIANT", "avx9")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_KERNEL_VARIANT"):
        loader.requested_variant()


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (a process loads one variant, once)."""
    base = {k: v for k, v in os.environ.items() if k not in _LOADER_ENV}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=1800,
    )


_PROBE = """
    from pagedllm.ops import cpu_ops_error, load_cpu_ops
    print("ops:", load_cpu_ops())
    print("error:", cpu_ops_error())
"""


def test_disabled_by_env() -> None:
    r = _run(_PROBE, PAGEDLLM_DISABLE_CPU_KERNELS="1")
    assert r.returncode == 0, r.stderr
    assert "ops: None" in r.stdout and "PAGEDLLM_DISABLE_CPU_KERNELS" in r.stdout


def test_no_compiler_falls_back_with_one_warning() -> None:
    r = _run(_PROBE, CXX="/nonexistent/c++")
    assert r.returncode == 0, r.stderr
    assert "ops: None" in r.stdout and "no C++ compiler" in r.stdout
    assert r.stderr.count("RuntimeWarning") == 1 and "falling back" in r.stderr


def test_variant_the_cpu_cannot_run_is_refused() -> None:
    if not missing_flags("avx512"):
        pytest.skip("this CPU runs the avx512 variant")
    r = _run(_PROBE, PAGEDLLM_CPU_KERNEL_VARIANT="avx512")
    assert r.returncode == 0, r.stderr
    assert "ops: None" in r.stdout and "avx512f" in r.stdout


# A check of one variant in its own process: builds (or loads) it, then compares the attention,
# layer ops and GEMM with PyTorch.
_VARIANT_CHECK = """
    import math, logging, torch, torch.nn.functional as F
    logging.basicConfig(level=logging.INFO)
    from pagedllm.ops import cpu_ops_error, load_cpu_ops
    ops = load_cpu_ops()
    assert ops is not None, cpu_ops_error()
    print("simd:", ops.simd_level())
    torch.manual_seed(0)
    # one sequence of 37 tokens, 2 kv heads x 2 query heads each, head_dim 40, blocks of 8
    H, KVH, D, BS, L = 4, 2, 40, 8, 37
    kc, vc = torch.zeros(KVH, 6, BS, D), torch.zeros(KVH, 6, BS, D)
    table = torch.tensor([[5, 0, 3, 1, 2]])
    k, v = torch.randn(L, KVH, D), torch.randn(L, KVH, D)
    slots = torch.tensor([table[0, p // BS].item() * BS + p % BS for p in range(L)])
    ops.reshape_and_cache(k, v, kc, vc, slots)
    q, out = torch.randn(1, H, D), torch.empty(1, H, D)
    scale = 1 / math.sqrt(D)
    ops.paged_attention_decode(out, q, kc, vc, table, torch.tensor([L]), 1, scale, 16)
    kr, vr = k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)
    p = torch.softmax(torch.einsum("hd,lhd->hl", q[0], kr) * scale, -1)
    torch.testing.assert_close(out[0], torch.einsum("hl,lhd->hd", p, vr), atol=1e-4, rtol=1e-4)
    # sliding window of 10: only the last 10 keys count (decode), and the prefill's last query
    W = 10
    ops.paged_attention_decode(out, q, kc, vc, table, torch.tensor([L]), 1, scale, 16, W)
    p = torch.softmax(torch.einsum("hd,lhd->hl", q[0], kr[L - W :]) * scale, -1)
    want = torch.einsum("hl,lhd->hd", p, vr[L - W :])
    torch.testing.assert_close(out[0], want, atol=1e-4, rtol=1e-4)
    qs = torch.tensor([0, 1])
    ops.paged_attention_prefill(out, q, kc, vc, table, torch.tensor([L]), qs, 0, 1, scale, 16, W)
    torch.testing.assert_close(out[0], want, atol=1e-4, rtol=1e-4)
    x, w = torch.randn(5, 96), torch.randn(96)
    y = torch.empty_like(x)
    ops.rms_norm(y, x, w, 1e-6)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    gu, act = torch.randn(5, 64), torch.empty(5, 32)
    ops.silu_and_mul(act, gu)
    torch.testing.assert_close(act, F.silu(gu[:, :32]) * gu[:, 32:], atol=1e-5, rtol=1e-5)
    W = torch.randn(40, 96)
    torch.testing.assert_close(
        ops.gemm_linear(x, ops.gemm_pack_weight(W), 40), x @ W.T, atol=1e-4, rtol=1e-4
    )
    # native GGUF kernels (both scale layouts of each kind) against the dequantized weight
    # times the activation rounded as the kernel rounds it (per 32, int8, max|x| / 127)
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from pagedllm.model.quant.gguf_native import GGUFLinear, repack
    rng = np.random.default_rng(0)
    xg = torch.from_numpy(rng.standard_normal((3, 64)).astype(np.float32))
    blocks = xg.reshape(3, -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    xq = (torch.round(blocks / d) * d).reshape(3, 64)
    for qt in ("Q4_1", "Q8_0"):
        kind = GGMLQuantizationType[qt]
        raw = np.asarray(quantize(rng.standard_normal((11, 64)).astype(np.float32), kind))
        wq = torch.from_numpy(np.asarray(dequantize(raw, kind), dtype=np.float32).reshape(11, 64))
        p = repack(qt, raw, 11)
        for part in (p, p.widened()):
            y = GGUFLinear([part], ops)(xg)
            torch.testing.assert_close(y, xq @ wq.T, atol=1e-3, rtol=1e-4)
    print("ok")
"""


def _check_variant(variant: str, tmp_path: Path) -> None:
    r = _run(
        _VARIANT_CHECK,
        PAGEDLLM_CPU_KERNEL_VARIANT=variant,
        PAGEDLLM_KERNEL_CACHE_DIR=os.environ.get(
            "PAGEDLLM_KERNEL_CACHE_DIR", str(tmp_path / "kernels")
        ),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"simd: {variant}" in r.stdout and "ok" in r.stdout, r.stdout
    assert f"pagedllm C++ CPU kernels: variant {variant}" in r.stderr, r.stderr


@pytest.mark.slow
def test_scalar_variant_runs(tmp_path: Path) -> None:
    _check_variant("scalar", tmp_path)


@pytest.mark.slow
def test_avx512_variant_runs(tmp_path: Path) -> None:
    missing = missing_flags("avx512")
    if missing:
        pytest.skip(f"the avx512 variant needs CPU flags this CPU lacks: {' '.join(missing)}")
    _check_variant("avx512", tmp_path)


@pytest.mark.slow
def test_avx512_variant_compiles(tmp_path: Path) -> None:
    """Compiled (not linked or loaded) here even on a CPU without AVX-512."""
    # A lasting folder (the test run's kernel cache): identical sources are checked once.
    out = Path(os.environ.get("PAGEDLLM_KERNEL_CACHE_DIR", tmp_path)) / "pagedllm_compile_check"
    try:
        objects = loader.compile_check("avx512", out)
    except subprocess.CalledProcessError as e:
        pytest.fail(f"avx512 variant does not compile:\n{e.stdout}\n{e.stderr}")
    assert len(objects) == len(loader.SOURCES) and all(o.stat().st_size > 0 for o in objects)


@pytest.mark.parametrize(
    ("value", "off", "warns"),
    [(None, False, False), ("", False, False), ("0", True, False), (" False ", True, False),
     ("no", True, False), ("OFF", True, False), ("1", False, False), ("on", False, False),
     ("banana", False, True)],
)  # fmt: skip
def test_feature_switches_read_the_usual_off_words(monkeypatch, caplog, value, off, warns) -> None:
    """PAGEDLLM_ATTENTION_BF16_DOT / PAGEDLLM_GEMM_AMX: 0, false, no, off turn the feature off;
    anything else leaves it on, and a value that is no switch word is logged."""
    if value is None:
        monkeypatch.delenv("PAGEDLLM_GEMM_AMX", raising=False)
    else:
        monkeypatch.setenv("PAGEDLLM_GEMM_AMX", value)
    with caplog.at_level("WARNING", logger=loader.__name__):
        assert loader.env_turns_off("PAGEDLLM_GEMM_AMX") is off
    assert ("PAGEDLLM_GEMM_AMX" in caplog.text) is warns
