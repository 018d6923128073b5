"""``MultiModelApp`` within a memory budget in bytes (each model counted as its engine's weights +
KV pools), and its graceful drain. Two tiny random models of the same shape, so each holds the
same, exactly computable number of bytes."""

from __future__ import annotations

import asyncio
import gc
import weakref

import httpx
import pytest

from pagedllm.entrypoints.openai.app import build_app
from pagedllm.serving.multi_model import MultiModelApp
from tests.entrypoints.server_utils import (
    ServerThread,
    assert_error,
    check_drained_stream,
    start_serve_process,
    stream_through_sigterm,
)
from tests.entrypoints.test_overload import hold_engine_after_first_text, wait_for

BLOCK_SIZE = 16
ENGINE_ARGS = {
    "max_model_len": 128,
    "kv_cache_memory": 1 << 21,
    "swap_space": 1 << 20,
    "num_threads": 1,
    "block_size": BLOCK_SIZE,
    "dtype": "float32",
}
PROMPT = "the quick brown fox jumps over the lazy dog"
C = "/v1/completions"


@pytest.fixture(scope="module")
def model_bytes(tiny_loaded) -> int:
    """Weights + KV block pool + swap pool of one tiny model, computed from the shapes."""
    cfg = tiny_loaded.config
    weights = sum(t.numel() * t.element_size() for t in tiny_loaded.state_dict.values())
    block = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * BLOCK_SIZE
    blocks = ENGINE_ARGS["kv_cache_memory"] // block + ENGINE_ARGS["swap_space"] // block
    return weights + blocks * block


def make_front(models, built: list | None = None, **kw) -> MultiModelApp:
    """The front over both models; each model build appends (name, models loaded at that
    moment) to ``built``."""
    front: MultiModelApp

    def make(name, loaded):
        def factory():
            if built is not None:
                built.append((name, sorted(front.loaded)))
            return build_app(
                dict(ENGINE_ARGS), loaded=loaded, served_model_name=name, log_stats_interval=0
            )

        return factory

    front = MultiModelApp({name: make(name, m) for name, m in models.items()}, **kw)
    return front


async def post_each(front: MultiModelApp, names: list[str]) -> list[httpx.Response]:
    """POST one short greedy completion per name, in order; then unload everything."""
    out = []
    transport = httpx.ASGITransport(app=front)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        for name in names:
            body = {"model": name, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
            out.append(await c.post(C, json=body))
            out[-1].loaded = list(front.loaded)  # type: ignore[attr-defined]
    for s in front.slots.values():
        await front._unload(s)
    return out


def test_measured_bytes_are_weights_plus_kv_pools(models, model_bytes):
    front = make_front(models, memory_budget=10 * model_bytes)
    rs = asyncio.run(post_each(front, ["tiny-a", "tiny-b"]))
    assert [r.status_code for r in rs] == [200, 200]
    assert rs[1].loaded == ["tiny-a", "tiny-b"]  # both fit: nothing unloaded
    assert [s.memory_bytes for s in front.slots.values()] == [model_bytes, model_bytes]
    assert front.num_unloads == 2  # the two of post_each's clean-up


def test_unloading_frees_the_engine(models):
    """An unloaded model's engine (weights, KV pools) is garbage even while its app is still
    referenced (FastAPI's caches of route functions keep apps alive; the test holds it here)."""
    front = make_front(models)

    async def main() -> tuple[object, weakref.ref]:
        transport = httpx.ASGITransport(app=front)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.post(C, json={"model": "tiny-a", "prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == 200
        app = front.slots["tiny-a"].app
        engine_ref = weakref.ref(app.state.async_engine.engine)
        await front._unload(front.slots["tiny-a"])
        return app, engine_ref

    app, engine_ref = asyncio.run(main())
    gc.collect()
    assert engine_ref() is None and not hasattr(app.state.async_engine, "engine")


def test_budget_for_one_unloads_the_least_recently_used_first(models, model_bytes):
    """Room for one model: each switch unloads the idle one. With the size known (estimate, then
    measurement), the room is made before the next model is built."""
    built: list = []
    front = make_front(
        models,
        built,
        memory_budget=model_bytes + model_bytes // 2,
        memory_estimates={"tiny-a": model_bytes, "tiny-b": model_bytes},
    )
    rs = asyncio.run(post_each(front, ["tiny-a", "tiny-b", "tiny-a"]))
    assert [(r.status_code, r.loaded) for r in rs] == [
        (200, ["tiny-a"]),
        (200, ["tiny-b"]),
        (200, ["tiny-a"]),
    ]
    assert built == [("tiny-a", []), ("tiny-b", []), ("tiny-a", [])]
    assert front.num_loads == 3 and front.num_unloads == 3


def test_without_estimate_the_room_is_made_after_measuring(models, model_bytes):
    built: list = []
    front = make_front(models, built, memory_budget=model_bytes + model_bytes // 2)
    rs = asyncio.run(post_each(front, ["tiny-a", "tiny-b"]))
    assert [(r.status_code, r.loaded) for r in rs] == [(200, ["tiny-a"]), (200, ["tiny-b"])]
    assert built == [("tiny-a", []), ("tiny-b", ["tiny-a"])]  # built while tiny-a was loaded


def test_model_larger_than_the_budget_is_400_naming_model(models, model_bytes):
    front = make_front(models, memory_budget=model_bytes - 1)
    rs = asyncio.run(post_each(front, ["tiny-a", "tiny-a"]))
    for r in rs:
        err = assert_error(r, 400, "model", "model_too_large")
        assert str(model_bytes) in err["message"] and str(model_bytes - 1) in err["message"]
        assert r.loaded == []
    assert front.num_loads == 1  # the second request is refused from the measured size


def test_busy_models_are_not_unloaded_503(models, model_bytes):
    front = make_front(
        models,
        memory_budget=model_bytes,
        memory_estimates={"tiny-a": model_bytes, "tiny-b": model_bytes},
    )

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=front)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
            first = await c.post(C, json={**body, "model": "tiny-a"})
            front.slots["tiny-a"].in_flight += 1  # as if a request of tiny-a were streaming
            busy = await c.post(C, json={**body, "model": "tiny-b"})
            front.slots["tiny-a"].in_flight -= 1
            idle = await c.post(C, json={**body, "model": "tiny-b"})
        for s in front.slots.values():
            await front._unload(s)
        return [first, busy, idle]

    first, busy, idle = asyncio.run(main())
    assert first.status_code == 200 and idle.status_code == 200
    assert_error(busy, 503, None, "model_budget_full")
    assert busy.headers["retry-after"] == "1"
    assert front.num_loads == 2  # tiny-b was not built while tiny-a was busy


async def run_lifespan(front: MultiModelApp) -> tuple[dict, list[str]]:
    """Drive the ASGI lifespan: startup, then shutdown. Returns the startup's answer and the
    models loaded after it."""
    inbox: asyncio.Queue = asyncio.Queue()
    outbox: asyncio.Queue = asyncio.Queue()
    await inbox.put({"type": "lifespan.startup"})
    task = asyncio.create_task(front({"type": "lifespan"}, inbox.get, outbox.put))
    msg = await outbox.get()
    loaded = list(front.loaded)
    if msg["type"] == "lifespan.startup.complete":
        await inbox.put({"type": "lifespan.shutdown"})
        await outbox.get()
    await task
    return msg, loaded


def test_eager_startup_loads_what_fits_and_refuses_a_model_over_the_budget(models, model_bytes):
    msg, loaded = asyncio.run(
        run_lifespan(make_front(models, eager=True, memory_budget=model_bytes))
    )
    assert msg["type"] == "lifespan.startup.complete"
    assert loaded == ["tiny-a"]  # tiny-b did not fit: left for its first request
    msg, loaded = asyncio.run(
        run_lifespan(make_front(models, eager=True, memory_budget=model_bytes - 1))
    )
    assert msg["type"] == "lifespan.startup.failed" and loaded == []
    assert "`tiny-a` needs" in msg["message"]


def test_constructor_errors(models):
    with pytest.raises(ValueError, match="memory_budget"):
        make_front(models, memory_budget=0)
    with pytest.raises(ValueError, match="memory_estimates"):
        make_front(models, memory_estimates={"nope": 1})


# ---- graceful drain ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(models):
    srv = ServerThread(make_front(models)).start()
    yield srv
    srv.stop()


def test_drain_refuses_new_requests_and_lets_streams_finish(server):
    front: MultiModelApp = server.app
    body = {"model": "tiny-b", "prompt": PROMPT, "max_tokens": 20, "temperature": 0}
    body |= {"stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        try:
            assert client.post(C, json={"model": "tiny-b", "prompt": "hi"}).status_code == 200
            # Armed before the request (tiny-b is loaded now): holding after the first event
            # races the stream's end.
            release = hold_engine_after_first_text(front.slots["tiny-b"].app.state.async_engine)
            with client.stream("POST", C, json=body) as r:
                lines = r.iter_lines()
                next(line for line in lines if line)
                fut = asyncio.run_coroutine_threadsafe(front.drain(30.0), front.event_loop)
                wait_for(lambda: front.lifecycle.draining)
                refused = client.post(C, json={"model": "tiny-a", "prompt": "hi"})
                assert_error(refused, 503, None, "server_draining")
                assert refused.headers["retry-after"] == "1"
                assert_error(client.get("/health"), 503, None, "server_draining")
                assert_error(client.get("/v1/models"), 503, None, "server_draining")
                assert client.get("/metrics", params={"model": "tiny-b"}).status_code == 200
                release.set()
                rest = [line for line in lines if line]
            assert fut.result(30) == 0  # nothing had to be aborted
            assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
            assert front.loaded == ["tiny-b"]  # refused requests loaded nothing
            # Grace period over: the in-flight stream is aborted with an error event.
            front.lifecycle.draining = False
            release = hold_engine_after_first_text(front.slots["tiny-b"].app.state.async_engine)
            with client.stream("POST", C, json=body) as r:
                lines = r.iter_lines()
                next(line for line in lines if line)
                fut = asyncio.run_coroutine_threadsafe(front.drain(0.1), front.event_loop)
                assert fut.result(30) == 1
                release.set()
                rest = [line for line in lines if line]
            assert rest[-1] == "data: [DONE]" and '"request_aborted"' in rest[-2]
        finally:
            front.lifecycle.draining = False
        wait_for(lambda: front.num_in_flight == 0)  # the front let go of both requests


@pytest.mark.slow  # a `pagedllm serve` process with two models, 400 streamed tokens (~60 s here)
def test_serve_two_models_sigterm_drains_in_flight_stream(tmp_path, hf_tiny_model, tiny_tokenizer):
    """``pagedllm serve A --model B``: SIGTERM lets B's stream finish while new requests get 503,
    then the process exits 0."""
    for name in ("tiny-a", "tiny-b"):
        hf_tiny_model.save_pretrained(tmp_path / name)
        tiny_tokenizer.save_pretrained(tmp_path / name)
    proc, url = start_serve_process(
        [str(tmp_path / "tiny-a"), "--model", str(tmp_path / "tiny-b")]
        + ["--max-model-len", "512", "--num-threads", "1", "--swap-space", "1MiB"]
        + ["--kv-cache-memory", "4MiB", "--shutdown-grace-period", "60"]
    )
    try:
        models = httpx.get(url + "/v1/models").json()["data"]
        assert [(m["id"], m["loaded"]) for m in models] == [("tiny-a", True), ("tiny-b", True)]
        body = {"model": "tiny-b", "prompt": "the quick brown fox", "max_tokens": 400}
        body |= {"stream": True, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        probe_body = {"model": "tiny-a", "prompt": "hi"}
        lines, probe = stream_through_sigterm(proc, url, body, probe_body)
        chunks = check_drained_stream(proc, lines, probe, 400)
        assert {ch["model"] for ch in chunks} == {"tiny-b"}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
