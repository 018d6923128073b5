"""Text that is not valid Unicode (a lone UTF-16 surrogate, which a JSON ``\\ud83d`` escape can
write but UTF-8 cannot encode) is a 400 naming the field on every endpoint, and a ``ValueError``
naming the field in ``LLM``; the tokenizer's ``TypeError`` (a 500) is never reached.

Found by the breaker pass: ``{"prompt": "a\\ud83d"}`` was a 500 ``internal error: TypeError``.
"""

from __future__ import annotations

import json

import pytest

from pagedllm.sampling_params import SamplingParams
from tests.entrypoints.server_utils import assert_error, healthy, start_tiny_server

LONE = "\ud83d"  # the high half of an emoji's surrogate pair, alone


@pytest.fixture(scope="module")
def server(tiny_loaded):
    srv = start_tiny_server(tiny_loaded)
    yield srv
    srv.stop()


CASES = [
    ("/v1/completions", {"prompt": "a" + LONE, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", LONE], "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" + LONE}]}, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"x": LONE}},
        "chat_template_kwargs",
    ),
    ("/v1/embeddings", {"input": ["a", LONE]}, "input"),
    ("/v1/responses", {"input": LONE, "max_output_tokens": 2}, "input"),
    ("/tokenize", {"prompt": LONE}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": LONE}]}, "messages"),
]


@pytest.mark.parametrize("path,body,param", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_lone_surrogate_is_400_naming_the_field(client, server, path, body, param):
    raw = json.dumps(body)  # ensure_ascii: the surrogate travels as the escape \ud83d
    assert "\\ud83d" in raw
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    err = assert_error(r, 400, param)
    assert "surrogate" in err["message"]
    healthy(server, client)


def test_surrogate_pair_is_valid_text(client, server):
    """An escaped pair (\\ud83d\\ude00 = U+1F600) is one valid character: tokenized, answered."""
    raw = json.dumps({"prompt": "a\U0001f600", "max_tokens": 2})
    assert "\\ud83d\\ude00" in raw
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    tok = server.engine.tokenizer
    assert r.json()["usage"]["prompt_tokens"] == len(tok("a\U0001f600").input_ids)


def test_llm_lone_surrogate_is_value_error(tiny_llm_factory):
    llm = tiny_llm_factory()
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="prompt holds a lone UTF-16 surrogate"):
        llm.generate(["a" + LONE], params)
    with pytest.raises(ValueError, match="messages holds a lone UTF-16 surrogate"):
        llm.chat([{"role": "user", "content": LONE}], params)
    assert len(llm.generate(["a\U0001f600"], params)[0].outputs[0].token_ids) == 2
