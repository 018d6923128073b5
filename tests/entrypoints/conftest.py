"""Fixtures shared by the server test files: each file defines its own module-scoped ``server``
(a ``ServerThread``); ``client`` talks to it, and every test that used it ends with the engine
idle and every KV block free."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.server_utils import wait_idle


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(autouse=True)
def _idle_after(request):
    yield
    if "server" in request.fixturenames:
        wait_idle(request.getfixturevalue("server").engine)
