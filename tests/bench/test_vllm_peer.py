"""benchmarks/vllm_cpu.py: a vLLM process that fails is reported with its signal and the CPU flags."""

import os
import stat
import sys
from pathlib import Path

import pytest

from pagedllm.platform import cpu_flags

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import vllm_cpu  # noqa: E402
from common import cpu_description  # noqa: E402


def fake_python(tmp_path: Path, body: str) -> Path:
    """An executable standing in for the vLLM venv's python."""
    exe = tmp_path / "python"
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


@pytest.fixture
def bench_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(vllm_cpu, "REPO", tmp_path)
    return tmp_path


def test_sigill_names_the_signal_the_flags_and_the_output(bench_repo: Path, monkeypatch):
    exe = fake_python(bench_repo, 'echo "loading vllm"; echo "last words"; kill -ILL $$')
    monkeypatch.setattr(vllm_cpu, "ensure_venv", lambda: exe)
    with pytest.raises(vllm_cpu.VllmFailed) as err:
        vllm_cpu.run_offline({"requests": []})
    msg = str(err.value)
    assert "killed by SIGILL" in msg and "AVX-512" in msg
    assert f"this CPU: {cpu_flags().summary()}" in msg
    assert msg.endswith("loading vllm\nlast words")
    assert (bench_repo / ".bench" / "vllm_offline.log").read_text() == "loading vllm\nlast words\n"


def test_exit_status_without_result_file_is_a_failure(bench_repo: Path, monkeypatch):
    exe = fake_python(bench_repo, 'echo "ValueError: no AVX512"; exit 3')
    monkeypatch.setattr(vllm_cpu, "ensure_venv", lambda: exe)
    with pytest.raises(vllm_cpu.VllmFailed, match=r"exit status 3;.*\nValueError: no AVX512$"):
        vllm_cpu.run_offline({"requests": []})


def test_success_returns_the_result_json(bench_repo: Path, monkeypatch):
    # argv: script --workload WL --out RES; the fake writes the result file as vllm_offline.py does.
    exe = fake_python(bench_repo, 'echo \'{"output_tok_s": 12.5, "dtype": "bfloat16"}\' > "$5"')
    monkeypatch.setattr(vllm_cpu, "ensure_venv", lambda: exe)
    assert vllm_cpu.run_offline({"requests": []}) == {"output_tok_s": 12.5, "dtype": "bfloat16"}


def test_describe_failure_keeps_only_the_tail():
    out = "\n".join(f"line {i}" for i in range(40))
    msg = vllm_cpu.describe_failure(2, out, lines=3)
    assert msg.splitlines()[1:] == ["line 37", "line 38", "line 39"]
    assert "exit status 2" in msg and "SIGILL" not in msg


def test_cpu_description_names_model_flags_and_cores():
    desc = cpu_description()
    name, flags, cores = desc.split(" | ")
    assert name and name != "unknown CPU" or not os.path.exists("/proc/cpuinfo")
    assert flags == f"flags: {cpu_flags().summary()}"
    assert cores == f"{os.cpu_count()} cores"
