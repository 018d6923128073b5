"""``import pagedllm`` sets the OpenMP barrier spin and PyTorch's huge-page allocation before torch
loads, and glibc's malloc thresholds (pagedllm.malloc_tuning), unless the user did."""

import os
import subprocess
import sys

import pytest

PROBE = "import os, pagedllm; print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"


def _probe(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "10000 None"),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, "None PASSIVE"),
        ({"GOMP_SPINCOUNT": "5"}, "5 None"),
    ],
)
def test_bounded_spin_unless_user_chose(env: dict[str, str], expected: str) -> None:
    assert _probe(**env) == expected


@pytest.mark.parametrize(("env", "expected"), [({}, "1"), ({"THP_MEM_ALLOC_ENABLE": "0"}, "0")])
def test_torch_huge_pages_unless_user_chose(env: dict[str, str], expected: str) -> None:
    clean = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    probe = "import os, pagedllm; print(os.environ.get('THP_MEM_ALLOC_ENABLE'))"
    out = subprocess.run(
        [sys.executable, "-c", probe], env={**clean, **env}, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == expected


# A step's temporaries: four 12.6 MB logits-sized buffers (batch 64 x a 49,152-token
# vocabulary, fp32) allocated, written and freed 30 times; prints whether the tuning applied and
# the minor page faults (/proc/self/stat field 10) of each of the last 10 iterations. glibc's
# defaults trim the freed heap top back to the OS every time (its trim threshold follows the
# largest freed buffer), so every iteration faults the memory in again and the kernel zeroes it.
FAULT_PROBE = """
import pagedllm, torch
from pagedllm import malloc_tuning
def minflt():
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])
torch.set_num_threads(1)
faults = []
for i in range(30):
    f0 = minflt()
    bufs = [torch.empty(64, 49152).fill_(1.0) for _ in range(4)]
    del bufs
    faults.append(minflt() - f0)
print(malloc_tuning.malloc_tuned, *faults[-10:])
"""


def _fault_probe(**env: str) -> tuple[str, list[int]]:
    drop = ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    clean = {k: v for k, v in os.environ.items() if k not in drop}
    out = subprocess.run(
        [sys.executable, "-c", FAULT_PROBE],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    tuned, *faults = out.stdout.split()
    return tuned, [int(f) for f in faults]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc and /proc: Linux")
def test_freed_step_buffers_stay_mapped() -> None:
    tuned, faults = _fault_probe()
    assert tuned == "True"
    untuned, faults_off = _fault_probe(PAGEDLLM_DISABLE_MALLOC_TUNING="1")
    assert untuned == "False"
    # Untuned: hundreds to thousands of faults per iteration (4 KiB or 2 MiB pages); tuned:
    # the memory stays mapped (the first iterations, not counted, map it).
    assert min(faults_off) > 100
    assert sorted(faults)[len(faults) // 2] == 0
    assert sum(faults) < sum(faults_off) / 10


@pytest.mark.parametrize(
    "env",
    [
        {"PAGEDLLM_DISABLE_MALLOC_TUNING": "1"},
        {"MALLOC_MMAP_THRESHOLD_": "65536"},
        {"MALLOC_TRIM_THRESHOLD_": "0"},
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
    ],
)
def test_malloc_tuning_leaves_user_settings(env: dict[str, str]) -> None:
    from pagedllm.malloc_tuning import keep_freed_memory

    assert keep_freed_memory(env) is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc: Linux")
def test_malloc_tuning_applies_by_default() -> None:
    from pagedllm.malloc_tuning import keep_freed_memory

    # An unrelated tunable does not count as the user's choice.
    assert keep_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}) is True
