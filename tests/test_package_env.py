"""``import pagedllm`` sets the OpenMP barrier spin and PyTorch's huge-page allocation before torch
loads, unless the user did."""

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
