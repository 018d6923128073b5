"""Fixtures of the model tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.model.test_loader import write_tiny_gguf


@pytest.fixture(scope="module")
def ops():  # noqa: ANN201
    """The C++ CPU kernels (``pagedllm.ops.CpuOps``); the test skips when they did not build."""
    from pagedllm.ops import cpu_ops_error, load_cpu_ops

    loaded = load_cpu_ops()
    if loaded is None:
        pytest.skip(f"the C++ CPU kernels are unavailable: {cpu_ops_error()}")
    return loaded


@pytest.fixture
def tiny_gguf_own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tiny GGUF with a tokenizer, and PAGEDLLM_CACHE_DIR set to an empty ``tmp_path/cache``."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tokenizer=True)
    return path
