"""Two tiny random models (different weights, different names) behind one endpoint
(``MultiModelApp``): each request is answered by the model it names, streaming included; models
load on first use and unload after an idle time."""

from __future__ import annotations

import time

import httpx
import pytest

from pagedllm.entrypoints.openai.app import build_app
from pagedllm.sampling_params import SamplingParams
from pagedllm.serving.multi_model import MultiModelApp
from tests.entrypoints.server_utils import ServerThread, assert_error, sse_events

ENGINE_ARGS = {"max_model_len": 128, "kv_cache_memory": 1 << 21, "num_threads": 1}
PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def reference(models):
    """Greedy tokens of each model run alone."""
    from pagedllm.entrypoints.llm import LLM

    out = {}
    for name, loaded in models.items():
        llm = LLM(loaded=loaded, **ENGINE_ARGS)
        res = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        out[name] = res[0].outputs[0].text
    assert out["tiny-a"] != out["tiny-b"]  # the test can tell the models apart
    return out


ALIASES = {"tiny-a": ["a2"]}  # tiny-a is also served as "a2"


@pytest.fixture(scope="module")
def server(models):
    factories = {
        name: (
            lambda name=name, loaded=loaded: build_app(
                dict(ENGINE_ARGS),
                loaded=loaded,
                served_model_name=[name, *ALIASES.get(name, [])],
                log_stats_interval=0,
            )
        )
        for name, loaded in models.items()
    }
    front = MultiModelApp(factories, idle_unload_s=4.0, max_loaded=2, aliases=ALIASES)
    srv = ServerThread(front).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_models_listed_and_loaded_lazily(server, client):
    front = server.app
    listed = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in listed] == ["tiny-a", "a2", "tiny-b"]
    # the fields of one model's cards; what the first load tells (root, max_model_len) is null
    want = {"object": "model", "created": front.created, "owned_by": "pagedllm", "root": None,
            "parent": None, "max_model_len": None, "loaded": False}
    assert listed[2] == {"id": "tiny-b", **want}
    for entry in listed:
        assert client.get(f"/v1/models/{entry['id']}").json() == entry
    err = assert_error(client.get("/v1/models/tiny-c"), 404, "model", "model_not_found")
    assert "`tiny-c`" in err["message"]
    assert front.loaded == []  # nothing loaded before the first request


def test_each_request_answered_by_its_model(server, client, reference):
    for name in ("tiny-b", "tiny-a", "tiny-b"):
        r = client.post(
            "/v1/completions",
            json={"model": name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        assert r.json()["model"] == name
        assert r.json()["choices"][0]["text"] == reference[name]
        events = sse_events(
            client,
            "/v1/completions",
            {"model": name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True},
        )
        text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
        assert text == reference[name]
    assert sorted(server.app.loaded) == ["tiny-a", "tiny-b"]


def test_alias_is_served_and_cards_equal_the_list(server, client, reference):
    """An alias (--served-model-name's further names) is answered by its model, reported under
    the model's first name as with one model (was 404 at the front, for POST and GET), and
    every card equals its /v1/models entry, with the loaded model's root and max_model_len
    (were missing: only id, object, owned_by, loaded)."""
    for name in ("a2", "tiny-b"):  # both loaded, and used just now (no idle unload meanwhile)
        body = {"model": name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        want = "tiny-a" if name == "a2" else name
        assert r.json()["model"] == want and r.json()["choices"][0]["text"] == reference[want]
    listed = client.get("/v1/models").json()["data"]
    for entry in listed:
        assert client.get(f"/v1/models/{entry['id']}").json() == entry
    assert [(m["id"], m["root"], m["max_model_len"], m["loaded"]) for m in listed] == [
        ("tiny-a", "tiny-a", 128, True),
        ("a2", "tiny-a", 128, True),
        ("tiny-b", "tiny-b", 128, True),
    ]
    assert client.get("/metrics", params={"model": "a2"}).status_code == 200


def test_aliases_are_checked():
    with pytest.raises(ValueError, match="aliases names unknown model"):
        MultiModelApp({"a": lambda: None}, aliases={"b": ["c"]})
    with pytest.raises(ValueError, match="'b' is served twice"):
        MultiModelApp({"a": lambda: None, "b": lambda: None}, aliases={"a": ["b"]})


def test_unknown_model_is_404_naming_model(client):
    r = client.post("/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["param"] == "model" and err["code"] == "model_not_found"
    r = client.post("/v1/chat/completions", json={"model": 3, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_idle_model_unloads_and_reloads_on_use(server, client, reference):
    front = server.app
    # A poll: a slot leaves ``loaded`` when its unload starts and counts in ``num_unloads``
    # once its engine thread has stopped, so wait for the count of both.
    deadline = time.monotonic() + 60
    while front.num_unloads < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert front.loaded == []
    unloads = front.num_unloads
    r = client.post(
        "/v1/completions",
        json={"model": "tiny-a", "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
    )
    assert r.json()["choices"][0]["text"] == reference["tiny-a"]
    assert front.loaded == ["tiny-a"] and unloads >= 2


def test_budget_of_one_model_swaps_the_least_recently_used(models, reference):
    """``max_loaded=1``: asking for the other model unloads the idle one first."""
    import asyncio

    factories = {
        name: (
            lambda name=name, loaded=loaded: build_app(
                dict(ENGINE_ARGS), loaded=loaded, served_model_name=name, log_stats_interval=0
            )
        )
        for name, loaded in models.items()
    }
    front = MultiModelApp(factories, max_loaded=1)

    async def main() -> list[tuple[str, list[str]]]:
        seen = []
        transport = httpx.ASGITransport(app=front)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            for name in ("tiny-a", "tiny-b", "tiny-a"):
                r = await c.post(
                    "/v1/completions",
                    json={"model": name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
                )
                seen.append((r.json()["choices"][0]["text"], front.loaded))
        for s in front.slots.values():
            await front._unload(s)
        return seen

    seen = asyncio.run(main())
    assert seen == [
        (reference["tiny-a"], ["tiny-a"]),
        (reference["tiny-b"], ["tiny-b"]),
        (reference["tiny-a"], ["tiny-a"]),
    ]
    assert front.num_loads == 3 and front.num_unloads == 3


def test_model_list_needs_the_api_key_when_set(models):
    import asyncio

    front = MultiModelApp({"tiny-a": lambda: None}, api_key="sekrit")

    async def main() -> tuple[int, int]:
        transport = httpx.ASGITransport(app=front)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            bad = await c.get("/v1/models")
            good = await c.get("/v1/models", headers={"Authorization": "Bearer sekrit"})
        return bad.status_code, good.status_code

    assert asyncio.run(main()) == (401, 200)
