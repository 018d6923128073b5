"""``logit_bias`` over HTTP: OpenAI's form (token ids as decimal string keys, values in
[-100, 100]) is applied as given; anything else is a 400 with the OpenAI envelope naming
``logit_bias``, on both generation endpoints, streamed or not, and the server serves on.

Found: values outside [-100, 100] were clamped silently (``{"1": 101}`` ran as 100), and keys that
Python's ``int()`` reads but are no decimal token ids (``" 1"``, ``"+1"``, ``"1_0"``, Arabic-Indic
``"\u0665"``) were accepted.
"""

from __future__ import annotations

import pytest

from tests.entrypoints.server_utils import assert_error, healthy, start_tiny_server

C = "/v1/completions"
CH = "/v1/chat/completions"
BASES = {C: '"prompt": "hi"', CH: '"messages": [{"role": "user", "content": "hi"}]'}


@pytest.fixture(scope="module")
def server(tiny_loaded):
    srv = start_tiny_server(tiny_loaded)
    yield srv
    srv.stop()


# (the logit_bias JSON, the start of the message); raw JSON for NaN and 1e999
BAD = [
    ('{"1": 101}', "logit_bias values must be in [-100, 100], got 101.0 for '1'"),
    ('{"1": -100.5}', "logit_bias values must be in [-100, 100], got -100.5 for '1'"),
    ('{"5": 1e3}', "logit_bias values must be in [-100, 100]"),
    ('{" 1": 1}', "logit_bias keys must be token ids (integers), got ' 1'"),
    ('{"+1": 1}', "logit_bias keys must be token ids (integers)"),
    ('{"1_0": 1}', "logit_bias keys must be token ids (integers)"),
    ('{"\\u0665": 1}', "logit_bias keys must be token ids (integers)"),
    ('{"1.5": 1}', "logit_bias keys must be token ids (integers)"),
    ('{"abc": 1}', "logit_bias keys must be token ids (integers)"),
    ('{"": 1}', "logit_bias keys must be token ids (integers)"),
    ('{"-1": 1}', "logit_bias keys must be token ids >= 0"),
    ('{"400": 1}', "logit_bias token ids must be in [0, 400) for this model, got 400"),
    ('{"123456789012345678901234567890": 1}', "logit_bias token ids must be in [0, 400)"),
    ('{"1": "x"}', "logit_bias: Input should be a valid number"),
    ('{"1": null}', "logit_bias: Input should be a valid number"),
    ('{"1": [1]}', "logit_bias: Input should be a valid number"),
    ('{"1": true}', "logit_bias: Value error, must be a number, not a boolean"),
    ('{"1": NaN}', "logit_bias values must be finite numbers"),
    ('{"1": 1e999}', "logit_bias values must be finite numbers"),
    ("[1]", "logit_bias: Input should be a valid dictionary"),
]


@pytest.mark.parametrize("bias,message", BAD, ids=[b for b, _ in BAD])
def test_bad_logit_bias_is_400_naming_the_field(client, server, bias, message):
    assert server.engine.vocab_size == 400  # the messages above name the tiny vocabulary
    for path, base in BASES.items():
        for stream in ("false", "true"):
            body = f'{{{base}, "max_tokens": 2, "stream": {stream}, "logit_bias": {bias}}}'
            r = client.post(path, content=body.encode(), headers={"content-type": "application/json"})
            err = assert_error(r, 400, "logit_bias")
            assert err["type"] == "invalid_request_error", err
            assert err["message"].startswith(message), err
    healthy(server, client)


def _first_tokens(client, bias: dict | None, n: int = 3) -> list[int]:
    body = {"prompt": "hello world", "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    if bias is not None:
        body["logit_bias"] = bias
    r = client.post(C, json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_limits_are_accepted_and_applied(client, server):
    """+-100 (and 0042, a decimal id with leading zeros) are OpenAI's form: applied as given."""
    assert _first_tokens(client, {"42": 100}) == [42, 42, 42]
    assert _first_tokens(client, {"0042": 100.0}) == [42, 42, 42]
    greedy = _first_tokens(client, None, 1)[0]
    assert _first_tokens(client, {str(greedy): -100}, 1)[0] != greedy
    r = client.post(CH, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "temperature": 0, "logit_bias": {"42": 100}, "ignore_eos": True,
                              "return_token_ids": True})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [42, 42], r.text
    # the bias does not outlive its request
    assert _first_tokens(client, None, 1)[0] == greedy
    healthy(server, client)
