"""CPU flag parsing and the kernel variant it picks (pagedllm.platform)."""

from __future__ import annotations

import dataclasses

import pytest

from pagedllm.platform import (
    CpuFlags,
    cpu_flags,
    cpu_kernel_variant,
    missing_flags,
    parse_cpuinfo,
)

_BASE = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse "
    "sse2 ht syscall nx lm constant_tsc rep_good nopl pni pclmulqdq ssse3 cx16 sse4_1 sse4_2 "
    "movbe popcnt aes xsave avx rdrand hypervisor lahf_lm abm"
)


def _cpuinfo(flags: str, model: str) -> str:
    # Two processors, as the kernel prints them; only the first flags line is read.
    block = (
        "processor\t: {n}\nvendor_id\t: x\nmodel name\t: {model}\n"
        "flags\t\t: {flags}\nbogomips\t: 4890.81\n\n"
    )
    return block.format(n=0, model=model, flags=flags) + block.format(n=1, model=model, flags=flags)


ZEN3 = _cpuinfo(
    _BASE + " fma f16c bmi1 avx2 smep bmi2 erms sha_ni clzero vaes vpclmulqdq rdpid fsrm",
    "AMD EPYC 7B13 (Zen 3)",
)
SKYLAKE_SP = _cpuinfo(
    _BASE + " fma f16c bmi1 avx2 bmi2 avx512f avx512dq avx512cd avx512bw avx512vl clwb",
    "Intel Xeon Platinum 8175M",
)
CASCADE_LAKE = _cpuinfo(
    _BASE + " fma f16c avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni",
    "Intel Xeon Platinum 8275CL",
)
SAPPHIRE_RAPIDS = _cpuinfo(
    _BASE + " fma f16c avx2 avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx_vnni "
    "avx512_bf16 avx512vbmi avx512_vnni avx512_bitalg amx_bf16 amx_tile amx_int8",
    "Intel Xeon Platinum 8488C",
)
SANDY_BRIDGE = _cpuinfo(_BASE, "Intel Xeon E5-2670 (AVX, no AVX2)")
GRAVITON = (
    "processor\t: 0\nBogoMIPS\t: 243.75\n"
    "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm\n"
    "CPU implementer\t: 0x41\n"
)


@pytest.mark.parametrize(
    ("text", "variant"),
    [
        (ZEN3, "avx2"),
        (SKYLAKE_SP, "avx512"),
        (CASCADE_LAKE, "avx512"),
        (SAPPHIRE_RAPIDS, "avx512"),
        (SANDY_BRIDGE, "scalar"),
        (GRAVITON, "scalar"),
        ("", "scalar"),
    ],
    ids=["zen3", "skylake_sp", "cascade_lake", "sapphire_rapids", "sandy_bridge", "arm", "empty"],
)
def test_variant_from_cpuinfo(text: str, variant: str) -> None:
    assert cpu_kernel_variant(parse_cpuinfo(text)) == variant


def test_flags_of_each_cpu_kind() -> None:
    zen3 = parse_cpuinfo(ZEN3)
    assert zen3.avx2 and zen3.fma and zen3.f16c
    assert not (zen3.avx512f or zen3.avx512_bf16 or zen3.avx512_vnni or zen3.amx_bf16)
    assert missing_flags("avx512", zen3) == ["avx512f", "avx512bw", "avx512vl", "avx512dq"]
    assert missing_flags("avx2", zen3) == []

    skx = parse_cpuinfo(SKYLAKE_SP)
    assert skx.avx512f and skx.avx512bw and not skx.avx512_vnni and not skx.amx_int8

    spr = parse_cpuinfo(SAPPHIRE_RAPIDS)
    assert spr.avx512_bf16 and spr.avx512_vnni and spr.amx_bf16 and spr.amx_int8
    assert spr.has("amx_tile") and not spr.has("sve")
    assert "amx_int8" in spr.summary()

    # An Alder Lake laptop: AVX-VNNI (VEX vpdpbusd) without AVX-512.
    adl = parse_cpuinfo("flags\t: sse4_2 avx2 fma f16c avx_vnni")
    assert adl.avx_vnni and not adl.avx512_vnni and "avx_vnni" in adl.summary()

    arm = parse_cpuinfo(GRAVITON)
    assert arm.has("asimd") and not arm.avx2
    assert missing_flags("avx2", arm) == ["avx2", "fma", "f16c"]
    assert missing_flags("scalar", arm) == []


def test_flags_are_frozen_and_unknown_variant_rejected() -> None:
    flags = parse_cpuinfo(ZEN3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        flags.avx2 = False  # type: ignore[misc]
    with pytest.raises(ValueError, match="unknown CPU kernel variant"):
        missing_flags("avx1024", flags)


def test_torch_capability_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import pagedllm.platform as plat

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    flags = plat._from_torch_capability()
    assert flags.source == "torch" and flags.avx512f and flags.avx2
    assert cpu_kernel_variant(flags) == "avx512"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert cpu_kernel_variant(plat._from_torch_capability()) == "scalar"


def test_this_cpu() -> None:
    flags = cpu_flags()
    assert isinstance(flags, CpuFlags) and cpu_flags() is flags  # read once
    assert cpu_kernel_variant() in ("avx512", "avx2", "scalar")
    assert missing_flags(cpu_kernel_variant()) == []
