"""Speculative decoding through the OpenAI server: the per-request ``num_speculative_tokens``
field, its validation, and the vLLM-named counters in ``/metrics`` (tiny random Llama, fp32)."""

from __future__ import annotations

import re

import pytest

from pagedllm.entrypoints.openai.app import build_app
from tests.entrypoints.server_utils import ServerThread, assert_error

PROMPT = "one two three four one two three four one two three four one two"


@pytest.fixture(scope="module")
def server(tiny_loaded):
    app = build_app(
        {
            "max_model_len": 128,
            "kv_cache_memory": 1 << 22,
            "check_invariants": True,
            "num_threads": 1,
            # learn_step_cost off: the tests count drafts, which a timing-learned policy may cut.
            "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "learn_step_cost": False},
        },
        loaded=tiny_loaded,
        served_model_name="tiny",
    )
    srv = ServerThread(app).start()
    yield srv
    srv.stop()


def _drafts(client) -> float:
    text = client.get("/metrics").text
    m = re.search(r'^vllm:spec_decode_num_draft_tokens_total\{[^}]*\} (\S+)$', text, re.M)
    assert m, "spec-decode counter missing from /metrics"
    return float(m.group(1))


def _complete(client, k: int | None) -> list[int]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    if k is not None:
        body["num_speculative_tokens"] = k
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_per_request_speculation_equals_off(client):
    before = _drafts(client)
    off = _complete(client, 0)
    assert _drafts(client) == before  # 0 = no proposals for this request
    on = _complete(client, 3)
    assert _drafts(client) > before  # the n-gram proposer found the prompt's repeats
    assert on == off and len(on) == 24
    assert _complete(client, None) == off  # the server default (3)


@pytest.mark.parametrize("bad", [-1, 1000, 1.5, "x"])
def test_bad_num_speculative_tokens_is_400(client, bad):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                             "num_speculative_tokens": bad})
    assert_error(r, 400, param="num_speculative_tokens")
