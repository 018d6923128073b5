"""A stopped app lets its engine go: nothing process-wide keeps the engine (its weights and KV
pool) alive once the app is dropped. The multi-model server builds a fresh app per load and
drops it when the model is unloaded, so an app that outlived its use leaked a whole model per
reload. Found through the test suite's own memory: FastAPI keeps the endpoint callables it has
inspected in a process-wide LRU cache (4096 entries), and endpoints written as closures over the
engine kept every engine ever served alive.
"""

from __future__ import annotations

import gc
import weakref

import httpx
import pytest

from pagedllm.entrypoints.openai.app import build_app
from tests.entrypoints.server_utils import ServerThread


@pytest.mark.parametrize("dashboard", [False, True], ids=["api", "api+dashboard"])
def test_dropped_app_frees_its_engine(tiny_loaded, dashboard):
    args = {"max_model_len": 128, "kv_cache_memory": 1 << 22, "num_threads": 1}
    app = build_app(args, loaded=tiny_loaded, served_model_name="tiny", enable_dashboard=dashboard)
    srv = ServerThread(app).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
            assert r.status_code == 200, r.text
            for path in ["/health", "/v1/models", "/metrics", "/openapi.json"]:
                assert c.get(path).status_code == 200, path
            if dashboard:
                assert c.get("/debug/engine_stats").status_code == 200
    finally:
        srv.stop()
    engine = weakref.ref(app.state.async_engine)
    model = weakref.ref(app.state.async_engine.engine)
    del app, srv
    gc.collect()
    assert engine() is None and model() is None, gc.get_referrers(engine() or model())[:3]
