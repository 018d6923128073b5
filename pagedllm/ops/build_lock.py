"""One kernel build at a time per build directory, and recovery from a build that was killed.

``torch.utils.cpp_extension.load`` guards a build directory with a ``lock`` file that it creates
exclusively and deletes when the build ends (its ``FileBaton``). A build killed part way (Ctrl-C
twice, OOM killer, a timed-out test) leaves that file behind, and every later ``load`` into the
directory then waits on it forever, silently.

We wrap torch's build in an advisory ``fcntl.flock`` on ``<build_dir>/pagedllm-build.flock``. The
operating system drops a flock when its holder exits, however it exits. So a process that holds
the flock knows no other pagedllm build of this directory is running: a torch ``lock`` file found
then was left by a dead build, and is removed with a warning. Waiting for the flock of a build
that really is running is bounded by ``$PAGEDLLM_KERNEL_BUILD_TIMEOUT`` seconds (default 1800);
past it :class:`TimeoutError` names the lock path.

Where ``fcntl`` does not exist (Windows) the lock falls back to age: a torch ``lock`` file older
than the timeout is taken as stale.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

TORCH_LOCK_NAME = "lock"  # torch.utils.cpp_extension: os.path.join(build_directory, 'lock')
FLOCK_NAME = "pagedllm-build.flock"
DEFAULT_TIMEOUT_S = 1800.0
_POLL_S = 0.2


def build_timeout_s() -> float:
    """Seconds to wait for another process's kernel build: ``$PAGEDLLM_KERNEL_BUILD_TIMEOUT``
    (default 1800). Raises ``ValueError`` naming the variable when it is not a positive number."""
    raw = os.environ.get("PAGEDLLM_KERNEL_BUILD_TIMEOUT", "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"PAGEDLLM_KERNEL_BUILD_TIMEOUT={raw!r}: expected a positive number")
    return value


def remove_stale_torch_lock(directory: Path) -> bool:
    """Delete ``directory/lock`` (torch's build lock) with a ``RuntimeWarning`` naming it.
    Call only while holding :func:`exclusive_build`. Returns whether a file was removed."""
    path = directory / TORCH_LOCK_NAME
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    warnings.warn(
        f"pagedllm: removed the stale kernel-build lock {path} (left by a build that was "
        "killed; no build of this directory is running)",
        RuntimeWarning,
        stacklevel=4,  # the caller of `with exclusive_build(...)` (through contextlib)
    )
    return True


@contextlib.contextmanager
def exclusive_build(directory: Path, timeout_s: float | None = None) -> Iterator[None]:
    """Hold the build of ``directory`` for this process, after clearing a stale torch lock.

    Args:
        directory: the build directory (exists).
        timeout_s: how long to wait for another process's build; default
            :func:`build_timeout_s`.

    Raises:
        TimeoutError: another process held the build for longer than ``timeout_s``; the message
            names the lock file.
    """
    timeout = build_timeout_s() if timeout_s is None else timeout_s
    if fcntl is None:  # pragma: no cover - Windows: judge torch's lock by its age
        lock = directory / TORCH_LOCK_NAME
        with contextlib.suppress(FileNotFoundError):
            if time.time() - lock.stat().st_mtime > timeout:
                remove_stale_torch_lock(directory)
        yield
        return
    flock_path = directory / FLOCK_NAME
    fd = os.open(flock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"another process has been building the CPU kernels in {directory} for "
                        f"over {timeout:.0f} s (lock {flock_path}); if no build is running, "
                        "delete that directory, or raise PAGEDLLM_KERNEL_BUILD_TIMEOUT"
                    ) from None
                time.sleep(_POLL_S)
        remove_stale_torch_lock(directory)
        yield
    finally:
        os.close(fd)  # also releases the flock
