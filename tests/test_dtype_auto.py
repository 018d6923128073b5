"""dtype="auto" (the default): bf16 where the hardware makes it pay (CUDA, AMX-BF16 or
AVX512-BF16 CPUs), fp32 elsewhere; the rule runs on injected CPU flags so every CPU kind is checked on any machine."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import EngineConfig, parse_dtype
from pagedllm.platform import AUTO_DTYPE_ENV, auto_dtype_name, cpu_flags, parse_cpuinfo

ZEN3 = "flags\t: fpu sse2 avx fma f16c avx2 bmi2\n"
SKYLAKE_AVX512 = "flags\t: avx2 fma f16c avx512f avx512bw avx512vl avx512dq\n"
XEON_AVX512_BF16 = "flags\t: avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_bf16\n"
XEON_AMX = XEON_AVX512_BF16.rstrip("\n") + " amx_tile amx_bf16 amx_int8\n"


@pytest.fixture
def no_override(monkeypatch):
    monkeypatch.delenv(AUTO_DTYPE_ENV, raising=False)


@pytest.mark.parametrize(
    ("cpuinfo", "expected"),
    [
        (ZEN3, "float32"),
        (SKYLAKE_AVX512, "float32"),
        (XEON_AVX512_BF16, "bfloat16"),
        (XEON_AMX, "bfloat16"),
    ],
)
def test_auto_rule_per_cpu_kind(no_override, cpuinfo, expected):
    assert auto_dtype_name("cpu", parse_cpuinfo(cpuinfo)) == expected


def test_auto_is_bf16_on_cuda(no_override):
    assert auto_dtype_name("cuda", parse_cpuinfo(ZEN3)) == "bfloat16"
    assert auto_dtype_name("cuda:1", parse_cpuinfo(ZEN3)) == "bfloat16"


def test_auto_is_fp32_for_gguf_weights_on_bf16_cpus(no_override):
    # The GGUF kernels decode several times slower with bf16 activations.
    for cpuinfo in (XEON_AVX512_BF16, XEON_AMX):
        assert auto_dtype_name("cpu", parse_cpuinfo(cpuinfo), "gguf") == "float32"
    assert auto_dtype_name("cpu", parse_cpuinfo(XEON_AMX)) == "bfloat16"
    assert EngineConfig(quantization="gguf").torch_dtype == torch.float32
    assert EngineConfig(quantization="gguf", dtype="bf16").torch_dtype == torch.bfloat16


def test_auto_for_int8_weights_follows_the_cpu(no_override):
    # int8 W8A8 layers run in the fused op with either dtype; bf16 speeds up the rest.
    for cpuinfo in (XEON_AVX512_BF16, XEON_AMX):
        assert auto_dtype_name("cpu", parse_cpuinfo(cpuinfo), "int8") == "bfloat16"
    assert auto_dtype_name("cpu", parse_cpuinfo(ZEN3), "int8") == "float32"
    assert EngineConfig(quantization="int8", dtype="float32").torch_dtype == torch.float32


def test_default_config_resolves_auto_on_this_cpu(no_override):
    flags = cpu_flags()
    expected = torch.bfloat16 if flags.amx_bf16 or flags.avx512_bf16 else torch.float32
    cfg = EngineConfig()
    assert cfg.dtype == "auto"
    assert cfg.torch_dtype == expected
    assert parse_dtype("auto") == expected


def test_env_override_wins(monkeypatch):
    monkeypatch.setenv(AUTO_DTYPE_ENV, "bfloat16")
    assert EngineConfig().torch_dtype == torch.bfloat16
    monkeypatch.setenv(AUTO_DTYPE_ENV, "float32")
    assert auto_dtype_name("cuda") == "float32"


def test_bad_override_is_a_dtype_error(monkeypatch):
    monkeypatch.setenv(AUTO_DTYPE_ENV, "int3")
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig()


def test_explicit_dtype_is_never_changed(no_override):
    assert EngineConfig(dtype="float32").torch_dtype == torch.float32
    assert EngineConfig(dtype="bf16").torch_dtype == torch.bfloat16


def test_vllm_dtype_names_and_the_error_lists_every_name(no_override):
    assert parse_dtype("half") == parse_dtype("FP16") == torch.float16
    assert parse_dtype("float") == torch.float32
    assert EngineConfig(dtype="half").torch_dtype == torch.float16
    with pytest.raises(ValueError, match=r"dtype must be auto, float32 \(fp32, float\), .*half\), got 'int8'"):
        parse_dtype("int8")
    with pytest.raises(ValueError, match="dtype must be torch.float32"):
        parse_dtype(torch.int8)
