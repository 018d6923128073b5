"""The kernel-build lock (pagedllm.ops.build_lock): a torch ``lock`` file left by a killed build is
removed with a warning; a build that is really running is waited for, with a bounded wait."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pagedllm.ops.build_lock import (
    FLOCK_NAME,
    TORCH_LOCK_NAME,
    build_timeout_s,
    exclusive_build,
)

pytest.importorskip("fcntl")


def test_stale_torch_lock_is_removed_with_a_warning(tmp_path: Path) -> None:
    stale = tmp_path / TORCH_LOCK_NAME
    stale.write_bytes(b"")  # what FileBaton leaves when its build is killed
    warns = pytest.warns(RuntimeWarning, match="stale kernel-build lock")
    with warns as record, exclusive_build(tmp_path, timeout_s=5):
        assert not stale.exists()
    assert str(stale) in str(record[0].message)


def test_no_lock_no_warning(tmp_path: Path, recwarn: pytest.WarningsRecorder) -> None:
    with exclusive_build(tmp_path, timeout_s=5):
        pass
    assert [w for w in recwarn if issubclass(w.category, RuntimeWarning)] == []


_HOLDER = """
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("held", flush=True)
    time.sleep(60)
"""


def test_running_build_is_waited_for_then_times_out_naming_the_lock(tmp_path: Path) -> None:
    (tmp_path / TORCH_LOCK_NAME).write_bytes(b"")  # a live build's lock: must not be touched
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_HOLDER), str(tmp_path / FLOCK_NAME)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=str(tmp_path / FLOCK_NAME)):  # noqa: SIM117
            with exclusive_build(tmp_path, timeout_s=0.5):
                pass
        assert time.monotonic() - t0 >= 0.5
        assert (tmp_path / TORCH_LOCK_NAME).exists()
    finally:
        holder.kill()
        holder.wait()
    # The holder died without cleaning up: its flock is gone and its torch lock is stale.
    with pytest.warns(RuntimeWarning, match="stale"), exclusive_build(tmp_path, timeout_s=5):
        assert not (tmp_path / TORCH_LOCK_NAME).exists()


def test_timeout_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDLLM_KERNEL_BUILD_TIMEOUT", raising=False)
    assert build_timeout_s() == 1800.0
    monkeypatch.setenv("PAGEDLLM_KERNEL_BUILD_TIMEOUT", "2.5")
    assert build_timeout_s() == 2.5
    for bad in ("0", "-1", "soon", "nan"):
        monkeypatch.setenv("PAGEDLLM_KERNEL_BUILD_TIMEOUT", bad)
        with pytest.raises(ValueError, match="PAGEDLLM_KERNEL_BUILD_TIMEOUT"):
            build_timeout_s()


# load_cpu_ops itself, in a fresh process, with torch's build replaced by a probe: it must find
# the stale lock already gone (before this fix torch would wait on it forever).
_LOADER_PROBE = """
    import torch.utils.cpp_extension as ext
    from pagedllm.ops import loader
    directory = loader.build_dir(loader.requested_variant())
    (directory / "lock").write_bytes(b"")
    def probe(**kwargs):
        print("lock present at build:", (directory / "lock").exists())
        raise RuntimeError("probe stops here")
    ext.load = probe
    print("ops:", loader.load_cpu_ops())
"""


def test_load_cpu_ops_clears_a_stale_lock(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PAGEDLLM_DISABLE_CPU_KERNELS"}
    env["PAGEDLLM_KERNEL_CACHE_DIR"] = str(tmp_path)
    env["PAGEDLLM_CPU_KERNEL_VARIANT"] = "scalar"
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_LOADER_PROBE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "lock present at build: False" in r.stdout, r.stdout + r.stderr
    assert "ops: None" in r.stdout
    assert "stale kernel-build lock" in r.stderr and "probe stops here" in r.stderr
