"""``--data-parallel-size 2`` on a KV pool smaller than ``max_model_len``: a request without
``max_tokens`` gets the same default as from one engine, cut to what the pool holds, on both
generation endpoints (a replica measures the room: ``DataParallelEngine.validate_request_async``).

Found: under data parallel the completions default (16) was cut to ``max_model_len`` only, so a
prompt leaving the pool less than 16 tokens of room got 400 "max_tokens: ... more KV blocks than
the whole pool", naming a field the client never sent; one engine answered it.
"""

from __future__ import annotations

import httpx
import pytest

from pagedllm.entrypoints.openai.app import build_app
from tests.entrypoints.server_utils import ServerThread, sse_events
from tests.serving.test_data_parallel import ray_local  # noqa: F401 - the module's Ray

pytestmark = pytest.mark.slow  # starts Ray and two engine processes (~30 s here)

ray = pytest.importorskip("ray")
POOL = 64  # 4 blocks of 16 tokens, under max_model_len 256
ENGINE_ARGS = {"max_model_len": 256, "num_gpu_blocks_override": 4, "block_size": 16,
               "num_threads": 1}


@pytest.fixture(scope="module")
def servers(ray_local, tiny_loaded):  # noqa: F811
    """(one engine, two data-parallel replicas) of the same model and pool."""
    one = ServerThread(build_app(dict(ENGINE_ARGS), loaded=tiny_loaded, log_stats_interval=0))
    dp = ServerThread(
        build_app(dict(ENGINE_ARGS), loaded=tiny_loaded, data_parallel_size=2,
                  log_stats_interval=0)
    )
    one.start()
    dp.start(timeout=120)
    yield one, dp
    dp.stop()
    one.stop()


def _answers(servers, path: str, body: dict) -> list[httpx.Response]:
    out = []
    for srv in servers:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            out.append(c.post(path, json=body))
    return out


def test_default_max_tokens_is_cut_to_the_pool_as_with_one_engine(servers):
    prompt = [5] * (POOL - 8)  # 8 tokens of room in the pool, less than the default 16
    body = {"prompt": prompt, "temperature": 0, "ignore_eos": True}
    one, dp = _answers(servers, "/v1/completions", body)
    assert one.status_code == 200, one.text
    assert dp.status_code == 200, dp.text  # was 400 naming max_tokens
    for r in (one, dp):
        (choice,) = r.json()["choices"]
        assert choice["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 8
    assert dp.json()["choices"][0]["text"] == one.json()["choices"][0]["text"]
    # streamed: the same text
    with httpx.Client(base_url=servers[1].url, timeout=60) as c:
        events = sse_events(c, "/v1/completions", {**body, "stream": True})
    text = "".join(ch["text"] for e in events[:-1] for ch in e["choices"])
    assert text == one.json()["choices"][0]["text"]
    # room for more than 16: the default stays 16
    one, dp = _answers(servers, "/v1/completions", {**body, "prompt": [5] * 8})
    assert [r.json()["usage"]["completion_tokens"] for r in (one, dp)] == [16, 16]


def test_chat_without_max_tokens_runs_to_the_pool_as_with_one_engine(servers):
    body = {"messages": [{"role": "user", "content": "hi " * 12}], "temperature": 0,
            "ignore_eos": True}
    one, dp = _answers(servers, "/v1/chat/completions", body)
    assert one.status_code == 200 and dp.status_code == 200, (one.text, dp.text)
    prompt_tokens = one.json()["usage"]["prompt_tokens"]
    assert 16 < prompt_tokens < POOL
    for r in (one, dp):
        assert r.json()["usage"]["completion_tokens"] == POOL - prompt_tokens
        assert r.json()["choices"][0]["finish_reason"] == "length"
    assert dp.json()["choices"][0]["message"] == one.json()["choices"][0]["message"]


def test_a_prompt_filling_the_pool_gets_the_same_400(servers):
    for path, body in (
        ("/v1/completions", {"prompt": [5] * POOL}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 40}]}),
    ):
        one, dp = _answers(servers, path, body)
        assert one.status_code == dp.status_code == 400, (one.text, dp.text)
        assert dp.json()["error"] == one.json()["error"]
        assert one.json()["error"]["param"] != "max_tokens"  # a field the client did not send
