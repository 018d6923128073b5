"""Fixtures of the model tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ops():  # noqa: ANN201
    """The C++ CPU kernels (``pagedllm.ops.CpuOps``); the test skips when they did not build."""
    from pagedllm.ops import cpu_ops_error, load_cpu_ops

    loaded = load_cpu_ops()
    if loaded is None:
        pytest.skip(f"the C++ CPU kernels are unavailable: {cpu_ops_error()}")
    return loaded
