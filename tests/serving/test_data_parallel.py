"""``--data-parallel-size 2``: two tiny-model replicas (Ray actors) behind the router, one app.

One local Ray instance per module (2 CPUs, one per replica). Every endpoint goes through the
router; greedy outputs equal one engine's; a killed replica fails or retries its requests and the
survivor keeps serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time

import httpx
import pytest

from pagedllm.entrypoints.openai.app import build_app
from pagedllm.entrypoints.openai.shutdown import drain
from pagedllm.sampling_params import SamplingParams
from tests.entrypoints.server_utils import ServerThread, assert_error, sse_events
from tests.entrypoints.test_overload import wait_for

pytestmark = pytest.mark.slow  # starts Ray and two engine processes (~30 s here)

ray = pytest.importorskip("ray")
ENGINE_ARGS = {"max_model_len": 256, "kv_cache_memory": 1 << 22, "num_threads": 1}
PROMPTS = [
    "the quick brown fox jumps over the lazy dog and paged attention stores keys",
    "a block table maps logical blocks to physical blocks; continuous batching lets",
    "hello world, hello engine; 123 456 789! the quick brown fox",
]


@pytest.fixture(scope="module")
def ray_local():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": root}},
    )
    yield
    ray.shutdown()  # this module's own local instance only


@pytest.fixture(scope="module")
def server(ray_local, tiny_loaded):
    app = build_app(
        dict(ENGINE_ARGS),
        loaded=tiny_loaded,
        served_model_name="tiny",
        data_parallel_size=2,
        router_policy="cache_aware",
        log_stats_interval=0,
    )
    srv = ServerThread(app).start(timeout=120)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_loaded):
    """Greedy completions of one engine (the exactness reference)."""
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(loaded=tiny_loaded, **ENGINE_ARGS)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def test_greedy_completions_equal_one_engine(client, reference):
    for prompt, want in zip(PROMPTS, reference, strict=True):
        r = client.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    # several prompts and n > 1 in one request
    r = client.post(
        "/v1/completions",
        json={"prompt": PROMPTS[:2], "max_tokens": 8, "temperature": 0, "n": 2},
    )
    texts = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    assert texts == [reference[0], reference[0], reference[1], reference[1]]


def test_streaming_chat_embeddings_tokenize_through_router(client, reference):
    events = sse_events(
        client,
        "/v1/completions",
        {"prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0, "stream": True},
    )
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert text == reference[2]
    chat = sse_events(
        client,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True},
    )
    assert chat[-1] == "[DONE]" and any(e["choices"] for e in chat[:-1])
    emb = client.post("/v1/embeddings", json={"input": ["a b", "c d"]}).json()
    assert [len(d["embedding"]) for d in emb["data"]] == [64, 64]
    tok = client.post("/tokenize", json={"prompt": "hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0


def test_bad_request_is_400_naming_the_field(client):
    r = client.post("/v1/completions", json={"prompt": "x" * 2000, "max_tokens": 8})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] in ("prompt", "max_tokens")


def test_responses_store_is_shared_at_the_router(client):
    first = client.post("/v1/responses", json={"input": "hello", "max_output_tokens": 4})
    assert first.status_code == 200, first.text
    rid = first.json()["id"]
    # follow-ups may land on either replica: the conversation lives in the front process
    for _ in range(3):
        r = client.post(
            "/v1/responses",
            json={"input": "again", "previous_response_id": rid, "max_output_tokens": 4},
        )
        assert r.status_code == 200, r.text
    assert client.get(f"/v1/responses/{rid}").status_code == 200


def test_cache_aware_routing_keeps_a_prefix_on_one_replica(server, client):
    dp = server.app.state.async_engine
    before = dict(dp.router.decisions)
    shared = PROMPTS[0] * 3
    for tail in ("one", "two", "three", "four"):
        r = client.post("/v1/completions", json={"prompt": shared + tail, "max_tokens": 2})
        assert r.status_code == 200
    assert dp.router.decisions["prefix"] - before.get("prefix", 0) == 4
    time.sleep(1.0)  # the next counters poll
    text = client.get("/metrics").text
    assert 'pagedllm:router_decisions_total{outcome="prefix",policy="cache_aware"}' in text
    assert 'pagedllm:replica_in_rotation{replica="1"} 1.0' in text
    hits = [c.prefix_cache_hit_tokens or 0 for c in (r.counters for r in dp.replicas) if c]
    assert max(hits) >= 3 * 16  # the shared blocks were found in one replica's cache


def hold_replicas(dp, release_file: str) -> None:
    """Park every replica's engine thread between two steps until ``release_file`` exists (the
    test's event across processes)."""

    def hold(replica) -> None:  # runs inside the replica actor (pickled by value)
        def wait(_engine) -> None:
            t0 = time.monotonic()
            while not os.path.exists(release_file) and time.monotonic() - t0 < 60:
                time.sleep(0.01)

        replica.engine.call_in_engine_thread(wait)

    ray.get([r.actor.__ray_call__.remote(hold) for r in dp.replicas])


def test_drain_lets_routed_streams_finish_then_aborts(server, client, tmp_path):
    """``drain`` (SIGTERM) on the data-parallel front: new requests 503, the routed stream runs
    to its end; with the grace period over it is aborted with an error event."""
    app = server.app
    dp = app.state.async_engine
    body = {"prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    body["stream"] = True

    def stream_lines() -> list[str]:
        with (
            httpx.Client(base_url=server.url, timeout=60) as c,
            c.stream("POST", "/v1/completions", json=body) as r,
        ):
            return [line for line in r.iter_lines() if line]

    try:
        for grace, left, last in ((30.0, 0, '"finish_reason":"length"'), (0.1, 1, "aborted")):
            release = tmp_path / f"release-{grace}"
            hold_replicas(dp, str(release))
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                lines = pool.submit(stream_lines)
                wait_for(lambda: dp.num_live_requests == 1)  # routed, held in its replica
                fut = asyncio.run_coroutine_threadsafe(drain(app, grace), dp.event_loop)
                wait_for(lambda: app.state.lifecycle.draining)
                refused = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                assert_error(refused, 503, None, "server_draining")
                assert_error(client.get("/health"), 503, None, "server_draining")
                if left:  # the short grace period runs out while the replicas are held
                    assert fut.result(30) == left
                release.touch()
                rest = lines.result(60)
            assert fut.result(30) == left
            assert rest[-1] == "data: [DONE]" and last in rest[-2], rest[-2:]
            app.state.lifecycle.draining = False
    finally:
        app.state.lifecycle.draining = False
        for grace in (30.0, 0.1):
            (tmp_path / f"release-{grace}").touch()
    wait_for(lambda: dp.num_live_requests == 0)


def test_killed_replica_requests_end_cleanly_and_survivor_serves(server, client, tmp_path):
    dp = server.app.state.async_engine
    body = {"prompt": PROMPTS[1], "max_tokens": 120, "ignore_eos": True, "temperature": 0}

    def one(_: int) -> int:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            return c.post("/v1/completions", json=body).status_code

    release = tmp_path / "release"
    # parked replicas keep every request in flight until the kill, however fast the engine is
    hold_replicas(dp, str(release))
    try:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futs = [pool.submit(one, i) for i in range(6)]
            wait_for(lambda: dp.num_live_requests == 6)
            victim = max(dp.replicas, key=lambda r: r.in_flight)
            assert victim.in_flight >= 1
            ray.kill(victim.actor, no_restart=False)
            release.touch()
            codes = [f.result(timeout=60) for f in futs]  # none hangs
    finally:
        release.touch()
    assert set(codes) <= {200, 503}, codes
    assert victim.failures >= 1
    # the survivor keeps serving while the victim restarts
    for _ in range(3):
        r = client.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 4})
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 150  # Ray restarts the actor: ~35 s on a quiet machine
    while not victim.in_rotation and time.monotonic() < deadline:
        time.sleep(0.5)
    assert victim.in_rotation, "the restarted replica did not come back"
