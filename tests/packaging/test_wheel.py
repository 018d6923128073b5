"""A non-editable install is complete: the wheel (and sdist) carry the C++ kernel sources and the
dashboard's static files, and ``pagedllm serve`` from a wheel installed into a fresh venv loads
the C++ kernels from the installed sources and answers a completion."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tarfile
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

from pagedllm.ops import loader
from pagedllm.platform import cpu_kernel_variant

REPO = Path(__file__).resolve().parents[2]
KERNEL_FILES = {f"pagedllm/csrc/cpu/{n}" for n in (*loader.SOURCES, *loader.HEADERS)}
# Environment that would change what the installed package does or where it builds.
_SCRUB = (
    "PYTHONPATH",
    "PAGEDLLM_DISABLE_CPU_KERNELS",
    "PAGEDLLM_CPU_KERNEL_VARIANT",
    "PAGEDLLM_CPU_ARCH_FLAGS",
    "TORCH_EXTENSIONS_DIR",
)


def _copy_source(dst: Path) -> Path:
    """The files a build reads, copied out of the checkout: building in place would leave
    ``build/`` and ``*.egg-info`` in it, and setuptools reuses a stale ``build/lib``."""
    dst.mkdir()
    for name in ("pyproject.toml", "README.md", "setup.py", "setup.cfg", "MANIFEST.in"):
        if (REPO / name).is_file():
            shutil.copy2(REPO / name, dst / name)
    for lic in REPO.glob("LICENSE*"):
        shutil.copy2(lic, dst / lic.name)
    shutil.copytree(
        REPO / "pagedllm", dst / "pagedllm", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    return dst


def _build_wheel(tmp_path: Path) -> Path:
    src = _copy_source(tmp_path / "src")
    out = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(src)],
        check=True, cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    (wheel,) = out.glob("pagedllm-*.whl")
    return wheel


def _wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def _wheel_metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return z.read(meta).decode()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return _build_wheel(tmp_path_factory.mktemp("wheel"))


def test_wheel_has_kernel_sources_static_files_and_server_deps(wheel: Path) -> None:
    names = _wheel_names(wheel)
    assert names >= KERNEL_FILES, sorted(KERNEL_FILES - names)
    static = {n for n in names if n.startswith("pagedllm/entrypoints/openai/static/")}
    expected = {
        f"pagedllm/entrypoints/openai/static/{p.name}"
        for p in (REPO / "pagedllm/entrypoints/openai/static").iterdir()
        if p.is_file()
    }
    assert expected and expected <= static, sorted(expected - static)
    meta = _wheel_metadata(wheel)
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    for dep in ("fastapi", "uvicorn", "prometheus-client", "torch==2.13.0"):
        assert any(dep in r and "extra ==" not in r for r in requires), (dep, requires)
    assert "Provides-Extra: serve" in meta


def test_sdist_has_kernel_sources(tmp_path: Path) -> None:
    src = _copy_source(tmp_path / "src")
    out = tmp_path / "sdist"
    code = (
        "import sys; from setuptools import build_meta; "
        f"print(build_meta.build_sdist({str(out)!r}))"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=src, capture_output=True, text=True
    )
    (sdist,) = out.glob("pagedllm-*.tar.gz")
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert names >= KERNEL_FILES, sorted(KERNEL_FILES - names)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fresh_venv(root: Path, wheel: Path) -> Path:
    """A new venv with ``wheel`` installed (no dependencies) that reuses this interpreter's
    installed packages through a ``.pth``; returns its python."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, capture_output=True
    )
    py = root / "bin" / "python"
    # pip of this environment, run by the new interpreter (which sees only its own packages yet).
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q",
         "--no-index", str(wheel)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    new_site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
    )  # fmt: skip
    # Appended after the venv's own site-packages. Lines of a .pth only extend sys.path: the
    # .pth files in the shared directory (the editable install of a checkout, whose finder maps
    # `pagedllm` to that checkout) are not processed, so `pagedllm` comes from the wheel.
    shared = sysconfig.get_paths()["purelib"]
    (new_site / "zz_shared_site_packages.pth").write_text(shared + "\n")
    return py


@pytest.mark.slow
def test_installed_wheel_serves_with_cpp_kernels(wheel: Path, tmp_path: Path) -> None:
    from pagedllm.model.loader.bundled import bundled_model_path

    try:
        model = bundled_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    py = _fresh_venv(tmp_path / "venv", wheel)
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
    env["PAGEDLLM_CACHE_DIR"] = str(tmp_path / "cache")  # the tokenizer is built here
    # The kernel cache of this test run (conftest): a build is keyed by a hash of the contents of
    # the sources the installed package holds (not their path), so the installed server loading
    # the build of this checkout's key proves it found every source, byte for byte, without a
    # second compile (1-2 minutes) of identical sources.
    kernel_cache = os.environ["PAGEDLLM_KERNEL_CACHE_DIR"]
    variant = cpu_kernel_variant()
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PAGEDLLM_CPU_ARCH_FLAGS", raising=False)  # scrubbed from the server's env
        same_build = Path(kernel_cache) / f"pagedllm_cpu_{variant}_{loader.build_key(variant)}"
    where = subprocess.run(
        [str(py), "-c", "import pagedllm; print(pagedllm.__file__)"],
        check=True, capture_output=True, text=True, cwd=tmp_path, env=env,
    ).stdout.strip()  # fmt: skip
    assert Path(where).resolve().is_relative_to((tmp_path / "venv").resolve()), where

    port = _free_port()
    log_path = tmp_path / "server.log"
    cmd = [str(tmp_path / "venv" / "bin" / "pagedllm"), "serve", "--model", str(model),
           "--port", str(port)]
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env=env,
            start_new_session=True,
        )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 1500  # a first kernel build: 1-2 min, more on a busy host
        while True:
            if server.poll() is not None:
                pytest.fail(f"server exited with {server.returncode}:\n{log_path.read_text()}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"no /health within the deadline:\n{log_path.read_text()}")
            time.sleep(1.0)

        body = json.dumps(
            {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        ).encode()  # fmt: skip
        req = urllib.request.Request(
            base + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            assert r.status == 200
            out = json.loads(r.read())
        assert out["choices"][0]["text"].strip(), out

        log_text = log_path.read_text()
        assert f"pagedllm C++ CPU kernels: variant {variant}" in log_text, log_text
        assert f"from {same_build}\n" in log_text, log_text
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(10)
