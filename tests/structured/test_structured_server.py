"""Structured-output request fields over HTTP on the tiny random Llama: ``response_format``,
``structured_outputs`` and the legacy ``guided_*`` fields constrain the reply, streamed and not;
bad values are a 400 naming the field the client used; the server stays healthy."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import pytest

from pagedllm.entrypoints.openai.app import build_app
from tests.entrypoints.server_utils import (
    ServerThread,
    assert_error,
    healthy,
    sse_events,
    wait_idle,
)

C, CH = "/v1/completions", "/v1/chat/completions"
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tiny_loaded):  # type: ignore[no-untyped-def]
    app = build_app(
        {"max_model_len": 256, "kv_cache_memory": 1 << 22, "check_invariants": True,
         "num_threads": 1},
        loaded=tiny_loaded,
        served_model_name="tiny",
    )
    srv = ServerThread(app).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):  # type: ignore[no-untyped-def]
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


@pytest.fixture(autouse=True)
def _idle_after(server):  # type: ignore[no-untyped-def]
    yield
    wait_idle(server.engine)  # no request left, every KV block free


def _body(path: str, **extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"max_tokens": 80, "temperature": 0.8, "seed": 3}
    if path == C:
        base["prompt"] = "hello"
    else:
        base["messages"] = [{"role": "user", "content": "hello"}]
    return {**base, **extra}




CASES = [
    (CH, {"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    (C, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    (CH, {"structured_outputs": {"regex": "[0-9]{4}"}}, lambda t: re.fullmatch("[0-9]{4}", t)),
    (C, {"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
    (CH, {"guided_regex": "(yes|no)!"}, lambda t: t in ("yes!", "no!")),
    (C, {"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    (C, {"guided_json": True}, lambda t: json.loads(t) is not None or t == "null"),  # any value
    (CH, {"guided_grammar": 'root ::= "x" [a-c]{2}'}, lambda t: re.fullmatch("x[a-c]{2}", t)),
]


@pytest.mark.parametrize(("path", "extra", "check"), CASES, ids=range(len(CASES)))
def test_constrained_reply_plain_and_streamed(client, path, extra, check) -> None:  # type: ignore[no-untyped-def]
    r = client.post(path, json=_body(path, **extra, n=2))
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        text = choice["text"] if path == C else choice["message"]["content"]
        assert choice["finish_reason"] == "stop" and check(text), text
    events = sse_events(client, path, {**_body(path, **extra), "stream": True})
    streamed = "".join(
        (e["choices"][0].get("text") if path == C else e["choices"][0]["delta"].get("content"))
        or "" for e in events[:-1] if e["choices"]
    )
    non_streamed = client.post(path, json=_body(path, **extra)).json()["choices"][0]
    assert streamed == (non_streamed["text"] if path == C else non_streamed["message"]["content"])
    assert check(streamed), streamed


BAD = [
    (CH, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    (CH, {"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format"),
    (C, {"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
    (C, {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    (C, {"structured_outputs": {"regexp": "a"}}, "structured_outputs"),
    (CH, {"guided_json": {"type": "objec"}}, "guided_json"),
    (CH, {"guided_json": "{not json"}, "guided_json"),
    (C, {"guided_regex": "(a"}, "guided_regex"),
    (C, {"guided_choice": []}, "guided_choice"),
    (CH, {"guided_grammar": "root ::= nope"}, "guided_grammar"),
    (CH, {"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
    (CH, {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format"),
    # keywords the grammar cannot enforce, and a regex whose language is empty
    (CH, {"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json"),
    (CH, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "if": {"minimum": 3}, "then": {"maximum": 4}}}}},
     "response_format"),
    (C, {"guided_regex": "[^\\x00-\\U0010FFFF]"}, "guided_regex"),
    (C, {"guided_json": False}, "guided_json"),  # the boolean schema that matches no value
    (CH, {"guided_json": {"type": "number", "multipleOf": 0.5}}, "guided_json"),
]


@pytest.mark.parametrize(("path", "extra", "param"), BAD, ids=range(len(BAD)))
def test_bad_constraint_is_400_naming_the_field(server, client, path, extra, param) -> None:  # type: ignore[no-untyped-def]
    for stream in (False, True):
        err = assert_error(
            client.post(path, json={**_body(path, **extra), "stream": stream}), 400, param
        )
        assert err["message"].startswith(param), err  # the request's field, in the text too
        assert param == "structured_outputs" or "structured_outputs" not in err["message"]
    healthy(server, client)
