"""A JSON boolean where the API wants a number (token ids, counts, sampling parameters) is a 400
naming the field, on every endpoint, and a ``ValueError`` in the engine: pydantic's lax mode (and
Python's ``bool`` being an ``int``) would otherwise read ``true`` as 1, so ``{"prompt": [true]}``
silently generated from token id 1 and ``"temperature": true`` sampled at 1.0. The other way
round too: a flag takes only ``true`` / ``false`` (lax mode read ``"stream": "yes"`` and
``"echo": 1`` as true), as OpenAI answers.
"""

from __future__ import annotations

import pytest

from pagedllm.sampling_params import SamplingParams
from tests.entrypoints.server_utils import assert_error, healthy, start_tiny_server


@pytest.fixture(scope="module")
def server(tiny_loaded):
    srv = start_tiny_server(tiny_loaded)
    yield srv
    srv.stop()


CHAT = [{"role": "user", "content": "hi"}]
CASES = [
    ("/v1/completions", {"prompt": [True]}, "prompt"),
    ("/v1/completions", {"prompt": [[5, False]]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": True}, "n"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [True]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": True}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "seed": False}, "seed"),
    ("/detokenize", {"tokens": [1, True]}, "tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": True}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": True}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": False}, "top_p"),
]


FLAG_CASES = [
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "hi", "echo": 1}, "echo"),
    ("/v1/completions", {"prompt": "hi", "ignore_eos": "true"}, "ignore_eos"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": 0}, "stream"),
    ("/v1/chat/completions", {"messages": CHAT, "add_generation_prompt": "on"}, "add_generation_prompt"),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "stream": True, "stream_options": {"include_usage": "y"}},
        "stream_options",
    ),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": 0}, "add_special_tokens"),
]


@pytest.mark.parametrize("path,body,param", FLAG_CASES, ids=[f"{c[0]}-{c[2]}" for c in FLAG_CASES])
def test_non_boolean_for_a_flag_is_400_naming_the_field(client, server, path, body, param):
    err = assert_error(client.post(path, json=body), 400, param)
    assert "boolean" in err["message"], err
    healthy(server, client)


@pytest.mark.parametrize("path,body,param", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_boolean_for_a_number_is_400_naming_the_field(client, server, path, body, param):
    err = assert_error(client.post(path, json=body), 400, param)
    assert "boolean" in err["message"], err
    healthy(server, client)


def test_integers_still_accepted(client, server):
    """The same fields with integers (3.0 is 3, as JSON numbers go) are answered."""
    r = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 3.0, "seed": 0})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (2, 3), usage


def test_engine_refuses_boolean_token_ids(server):
    """Below the HTTP layer (``LLM`` and engine callers): True is no token id either."""
    engine = server.engine
    with pytest.raises(ValueError, match="^prompt contains token ids that are not integers"):
        engine.validate_request([True], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="^stop_token_ids"):
        engine.validate_request([5], SamplingParams(max_tokens=2, stop_token_ids=[True]))
