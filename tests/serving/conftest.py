"""Fixtures of the serving tests: two tiny random models behind one endpoint."""

from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import make_random_state_dict


@pytest.fixture(scope="session")
def models(tiny_loaded):
    """name -> LoadedModel: the tiny Llama with seed 0 and the same shape with seed 1 (different
    weights, the same number of bytes)."""
    sd = make_random_state_dict(tiny_loaded.config, seed=1)
    return {"tiny-a": tiny_loaded, "tiny-b": dataclasses.replace(tiny_loaded, state_dict=sd)}
