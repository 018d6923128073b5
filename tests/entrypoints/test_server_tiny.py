"""Protocol, validation and error-envelope tests of the OpenAI server on the tiny random Llama.

A real uvicorn server on 127.0.0.1 (free port) runs the app in a thread; the engine checks the
block-manager invariants after every step. Every test ends with the engine idle and every KV
block free (autouse fixture).
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from pagedllm.entrypoints.openai.app import build_app
from tests.entrypoints.server_utils import (
    ServerThread,
    assert_error,
    check_chunk_shape,
    healthy,
    sse_events,
    wait_idle,
)

MODEL = "tiny"
MAX_LEN = 128


@pytest.fixture(scope="module")
def server(tiny_loaded):
    app = build_app(
        {
            "max_model_len": MAX_LEN,
            "kv_cache_memory": 1 << 22,
            "check_invariants": True,
            "max_logprobs": 5,
            "num_threads": 1,
        },
        loaded=tiny_loaded,
        served_model_name=MODEL,
        max_body_bytes=64 * 1024,
    )
    srv = ServerThread(app).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


# ---- plain endpoints --------------------------------------------------------------------------
def test_health_version_models_openapi(client):
    assert client.get("/health").status_code == 200
    assert "version" in client.get("/version").json()
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == MAX_LEN
    spec = client.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize"):
        assert path in spec["paths"]


def test_unknown_route_is_enveloped(client):
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/completions"), 405)


def test_tokenize_detokenize(client, server):
    tok = server.engine.tokenizer
    r = client.post("/tokenize", json={"prompt": "hello world"})
    assert r.status_code == 200
    ids = r.json()["tokens"]
    assert ids == tok("hello world").input_ids and r.json()["count"] == len(ids)
    assert r.json()["max_model_len"] == MAX_LEN
    r = client.post("/detokenize", json={"tokens": ids})
    assert r.json()["prompt"] == "hello world"
    r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["count"] > 1
    assert_error(client.post("/detokenize", json={"tokens": [len(tok) + 10]}), 400, "tokens")
    assert_error(client.post("/tokenize", json={}), 400, "prompt")
    both = {"prompt": "a", "messages": [{"role": "user", "content": "x"}]}
    assert_error(client.post("/tokenize", json=both), 400, "messages")  # was: messages won
    assert_error(client.post("/tokenize", json={"prompt": "x", "model": "nope"}), 404, "model")


def test_metrics(client):
    client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "temperature": 0})
    text = client.get("/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_preemptions_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:time_per_output_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_bucket",
        "vllm:request_prefill_time_seconds_count",
        'vllm:num_preemptions_by_mode_total{mode="swap"',
        "vllm:num_requests_swapped",
        "vllm:swap_out_bytes_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_hit_rate",
        "vllm:kv_sharing_saving_perc",
    ):
        assert name in text, name
    gen = [ln for ln in text.splitlines() if ln.startswith("vllm:generation_tokens_total")]
    assert float(gen[0].split()[-1]) >= 3

    def value(name: str) -> float:
        return float([ln for ln in text.splitlines() if ln.startswith(name)][0].split()[-1])

    # TTFT splits into queue + prefill time: one observation of each per finished request.
    n_ttft = value("vllm:time_to_first_token_seconds_count")
    assert n_ttft >= 1
    assert value("vllm:request_queue_time_seconds_count") == n_ttft
    assert value("vllm:request_prefill_time_seconds_count") == n_ttft
    split = value("vllm:request_queue_time_seconds_sum") + value(
        "vllm:request_prefill_time_seconds_sum"
    )
    assert split == pytest.approx(value("vllm:time_to_first_token_seconds_sum"), abs=1e-6)
    # A repeated long prompt hits the prefix cache: the hit counter moves.
    prompt = "paged attention stores keys and values in blocks " * 4

    def hits() -> float:
        lines = client.get("/metrics").text.splitlines()
        return float(
            [ln for ln in lines if ln.startswith("vllm:prefix_cache_hits_total")][0].split()[-1]
        )

    before = hits()
    for _ in range(2):
        client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert hits() > before


# ---- completions / chat basics -------------------------------------------------------------------
def test_completion_stream_equals_non_stream(oai):
    kw = dict(model=MODEL, prompt="the quick brown fox", max_tokens=12, temperature=0)
    full = oai.completions.create(**kw, extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    parts, finishes = [], []
    for chunk in oai.completions.create(**kw, stream=True, extra_body={"ignore_eos": True}):
        parts.append(chunk.choices[0].text)
        finishes.append(chunk.choices[0].finish_reason)
    assert "".join(parts) == full.choices[0].text
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])


def test_chat_stream_equals_non_stream(oai):
    msgs = [{"role": "user", "content": "hello engine"}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    full = oai.chat.completions.create(**kw)
    assert full.choices[0].message.role == "assistant"
    stream = oai.chat.completions.create(**kw, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full.choices[0].message.content


def test_model_may_be_omitted_and_unknown_is_404(client):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == MODEL
    assert_error(
        client.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"}),
        404,
        "model",
        "model_not_found",
    )


def test_prompt_forms_and_choice_indexes(client, server):
    tok = server.engine.tokenizer
    ids = tok("a block table").input_ids
    base = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
    single = client.post("/v1/completions", json={**base, "prompt": "a block table"}).json()
    r = client.post("/v1/completions", json={**base, "prompt": ids}).json()
    assert r["choices"][0]["text"] == single["choices"][0]["text"]
    r = client.post(
        "/v1/completions", json={**base, "prompt": ["a block table", "hello world", "x"]}
    ).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert r["choices"][0]["text"] == single["choices"][0]["text"]
    assert r["usage"]["completion_tokens"] == 9
    r = client.post("/v1/completions", json={**base, "prompt": [ids, ids]}).json()
    assert [c["text"] for c in r["choices"]] == [single["choices"][0]["text"]] * 2
    # streamed with several prompts: every index finishes exactly once
    events = sse_events(
        client, "/v1/completions", {**base, "prompt": ["a block table", "x"], "stream": True}
    )
    texts = check_chunk_shape(events, n=2, chat=False)
    assert texts[0] == single["choices"][0]["text"]


def test_chat_content_parts_and_generation_prompt(client):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
    assert r.status_code == 200, r.text
    img = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert_error(client.post("/v1/chat/completions", json={"messages": img}), 400, "messages")
    no_text = [{"role": "user", "content": [{"type": "text"}]}]
    err = assert_error(client.post("/v1/chat/completions", json={"messages": no_text}), 400,
                       "messages")
    assert "a text part needs a 'text' string" in err["message"]
    cont = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hel"}]
    r = client.post(
        "/v1/chat/completions",
        json={"messages": cont, "continue_final_message": True, "max_tokens": 2},
    )
    assert r.status_code == 200, r.text


def test_usage_reports_cached_tokens(client):
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1}).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


# ---- request edge cases ----------------------------------------------------------------------------
def test_c08_empty_prompt(client, server):
    for prompt in ("", [""], [], [[]]):
        assert_error(
            client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}), 400, "prompt"
        )
    r = client.post(
        "/v1/completions", json={"prompt": "", "max_tokens": 2, "stream": True}
    )  # no stream is opened for a rejected request
    assert_error(r, 400, "prompt")
    msgs = [{"role": "user", "content": ""}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
    assert r.status_code == 200, r.text
    healthy(server, client)


def test_c09_context_length(client, server):
    def ask(n, **kw):
        return client.post("/v1/completions", json={"prompt": [5] * n, "temperature": 0, **kw})

    for n in (MAX_LEN + 1, MAX_LEN):
        assert_error(ask(n), 400, "prompt", "context_length_exceeded")
    r = ask(MAX_LEN - 1)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1
    assert r.json()["choices"][0]["finish_reason"] == "length"
    err = assert_error(ask(120, max_tokens=16), 400, "max_tokens", "context_length_exceeded")
    assert "max_model_len" in err["message"]
    # chat: the prompt is named `messages`
    long = [{"role": "user", "content": "hello world " * 100}]
    assert_error(
        client.post("/v1/chat/completions", json={"messages": long}),
        400,
        "messages",
        "context_length_exceeded",
    )
    healthy(server, client)


def test_c10_echo_max_tokens_zero(client, server):
    prompt = "hello world, hello engine"
    n_prompt = len(server.engine.tokenizer(prompt).input_ids)
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["text"] == prompt
    assert r.json()["usage"]["completion_tokens"] == 0
    lps = ch["logprobs"]["token_logprobs"]
    assert len(lps) == n_prompt and lps[0] is None
    assert all(x is not None and x <= 0 for x in lps[1:])
    events = sse_events(client, "/v1/completions", {**body, "stream": True})
    texts = check_chunk_shape(events, chat=False)
    assert texts[0] == prompt
    streamed = [c["choices"][0]["logprobs"]["token_logprobs"] for c in events[:-1] if c["choices"]]
    assert sum(streamed, []) == lps
    # max_tokens=0 without echo is an error
    assert_error(
        client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}), 400, "max_tokens"
    )


def test_echo_with_tokens(client, server):
    r = client.post(
        "/v1/completions",
        json={"prompt": "hello", "max_tokens": 3, "echo": True, "ignore_eos": True},
    ).json()
    assert r["choices"][0]["text"].startswith("hello")


# ---- validation ------------------------------------------------------------------------------------
C = "/v1/completions"
CH = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

C22_CASES = [
    (C, {"temperature": -1}, "temperature"),
    (C, {"temperature": 3}, "temperature"),
    (C, {"top_p": 1.5}, "top_p"),
    (C, {"top_p": 0}, "top_p"),
    (C, {"top_k": -2}, "top_k"),
    (C, {"n": 0}, "n"),
    (C, {"max_tokens": -5}, "max_tokens"),
    (C, {"presence_penalty": 3}, "presence_penalty"),
    (C, {"frequency_penalty": -3}, "frequency_penalty"),
    (C, {"repetition_penalty": 0}, "repetition_penalty"),
    (C, {"min_p": 1.5}, "min_p"),
    (C, {"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    (C, {"logprobs": 6}, "logprobs"),
    (C, {"logprobs": -1}, "logprobs"),
    (C, {"echo": True, "logprobs": 6}, "logprobs"),
    (C, {"stop": [""]}, "stop"),
    (C, {"n": 2, "best_of": 1}, "best_of"),
    (C, {"logit_bias": {"abc": 1}}, "logit_bias"),
    (C, {"logit_bias": {"1": "x"}}, "logit_bias"),
    (C, {"temperature": "hot"}, "temperature"),
    (C, {"n": 1.5}, "n"),
    (C, {"seed": "x"}, "seed"),
    (C, {"stream_options": 5}, "stream_options"),
    (C, {"suffix": "x"}, "suffix"),
    (C, {"prompt": [1.5]}, "prompt"),
    (C, {"prompt": None}, "prompt"),
    (CH, {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    (CH, {"logprobs": True, "top_logprobs": 6}, "top_logprobs"),
    (CH, {"max_completion_tokens": 0}, "max_completion_tokens"),
    (CH, {"max_tokens": 0}, "max_tokens"),
    (CH, {"messages": []}, "messages"),
    (CH, {"messages": "hi"}, "messages"),
    (CH, {"messages": [{"content": "no role"}]}, "messages"),
    (CH, {"temperature": -1}, "temperature"),
    (CH, {"stop": [""]}, "stop"),
    (CH, {"response_format": {"type": "json_schema"}}, "response_format"),
    (CH, {"response_format": {"type": "yaml"}}, "response_format"),
    (CH, {"response_format": "json"}, "response_format"),
    (CH, {"tools": [{"type": "function"}]}, "tools"),
    (CH, {"tools": "nope"}, "tools"),
    (CH, {"tool_choice": "sometimes"}, "tool_choice"),
]


@pytest.mark.parametrize("path,extra,param", C22_CASES, ids=lambda x: str(x)[:40])
def test_c22_out_of_range_values(client, server, path, extra, param):
    body = {"prompt": "hello", "max_tokens": 4} if path == C else {"messages": MSG, "max_tokens": 4}
    body.update(extra)
    for stream in (False, True):
        r = client.post(path, json={**body, "stream": stream})
        assert_error(r, 400, param)


def test_c22_infinite_temperature(client):
    for path, body in (
        (C, '{"prompt": "hi", "temperature": 1e999}'),
        (CH, '{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}'),
    ):
        r = client.post(path, content=body.encode(), headers={"content-type": "application/json"})
        assert_error(r, 400, "temperature")


def test_c22_unknown_model_and_valid_forms(client, server):
    assert_error(client.post(CH, json={"model": "nope", "messages": MSG}), 404, "model")
    # a plain-string stop, -1 top_k, many stop strings, top_logprobs=0 are all valid
    for extra in (
        {"stop": "zzz"},
        {"top_k": -1},
        {"stop": ["a1", "b2", "c3", "d4", "e5", "f6"]},
        {"logit_bias": {"5": -100}},
    ):
        r = client.post(C, json={"prompt": "hello", "max_tokens": 2, **extra})
        assert r.status_code == 200, (extra, r.text)
    r = client.post(
        CH, json={"messages": MSG, "max_tokens": 2, "logprobs": True, "top_logprobs": 0}
    )
    assert r.status_code == 200, r.text
    healthy(server, client)


def test_c23_token_ids_outside_vocab(client, server):
    v = server.engine.vocab_size
    cases = [
        ({"prompt": "hi", "stop_token_ids": [v], "min_tokens": 1}, "stop_token_ids"),
        ({"prompt": [v]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": [[1, 2], [v]]}, "prompt"),
        ({"prompt": "hi", "logit_bias": {str(v): 5}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"-1": 5}}, "logit_bias"),
        ({"prompt": "hi", "stop_token_ids": [-3]}, "stop_token_ids"),
    ]
    for extra, param in cases:
        for stream in (False, True):
            assert_error(
                client.post(C, json={"max_tokens": 2, "stream": stream, **extra}), 400, param
            )
    assert_error(
        client.post(CH, json={"messages": MSG, "stop_token_ids": [v]}), 400, "stop_token_ids"
    )
    healthy(server, client)


def test_invalid_bodies(client, server):
    h = {"content-type": "application/json"}
    assert_error(client.post(C, content=b'{"prompt": "hi",', headers=h), 400, None)
    assert_error(client.post(C, content=b"[1, 2]", headers=h), 400, None)
    assert_error(client.post(C, content=b"", headers=h), 400)
    assert_error(client.post(C, content=b"\xff\xfe", headers=h), 400)
    assert_error(client.post(C, content=b'"just a string"', headers=h), 400)
    # a body over the limit (64 KiB for this app): 413, with or without Content-Length
    big = json.dumps({"prompt": "x" * 100_000}).encode()
    assert_error(client.post(C, content=big, headers=h), 413)

    def chunks():
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    assert_error(client.post(C, content=chunks(), headers=h), 413)
    healthy(server, client)


def test_n_greater_than_one_is_rejected_or_served(client):
    r = client.post(C, json={"prompt": "hi", "n": 2, "max_tokens": 2})
    if r.status_code == 400:
        assert_error(r, 400, "n")
    else:
        assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == [0, 1]


# ---- streaming protocol ------------------------------------------------------------------------------
def test_c18_chunk_shape_tiny(client):
    body = {"messages": MSG, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}
    events = sse_events(client, CH, body)
    check_chunk_shape(events)
    assert all("usage" not in e for e in events[:-1])
    events = sse_events(client, CH, {**body, "stream_options": {"include_usage": True}})
    check_chunk_shape(events)
    assert all(e["usage"] is None for e in events[:-2])
    last = events[-2]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6


def test_error_after_stream_started(client, server):
    """A step failing mid-stream: an error event then [DONE]; the engine stays alive."""
    eng = server.engine
    real_step = eng.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return real_step()

    eng.step = flaky_step
    try:
        body = {"prompt": "hello", "max_tokens": 20, "ignore_eos": True, "stream": True}
        with client.stream("POST", C, json=body) as r:
            assert r.status_code == 200
            raw = r.read().decode()
    finally:
        del eng.step
    blocks = [b for b in raw.split("\n\n") if b]
    assert blocks[-1] == "data: [DONE]"
    err = json.loads(blocks[-2][len("data: ") :])
    assert set(err) == {"error"} and "injected failure" in err["error"]["message"]
    assert server.app.state.async_engine.num_step_errors >= 1
    healthy(server, client)


def test_disconnect_frees_blocks(client, server):
    eng = server.engine
    body = {"prompt": "hello", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with client.stream("POST", C, json=body) as r:
        it = r.iter_lines()
        got = 0
        for line in it:
            if line.startswith("data: "):
                got += 1
                if got == 3:
                    break
        assert eng.block_manager.num_free_blocks < eng.block_manager.num_blocks
    # the connection is closed: the request is aborted and its blocks freed
    wait_idle(eng, timeout=5)
    assert eng.stats.generation_tokens > 0


def test_non_stream_disconnect_frees_blocks(server):
    eng = server.engine
    real_step = eng.step

    def slow_step():
        time.sleep(0.02)
        return real_step()

    eng.step = slow_step
    try:
        with httpx.Client(base_url=server.url, timeout=0.3) as c, pytest.raises(httpx.ReadTimeout):
            c.post(C, json={"prompt": "hello", "max_tokens": 120, "ignore_eos": True})
        wait_idle(eng, timeout=5)
    finally:
        del eng.step


def test_concurrent_streams_tiny(server):
    import concurrent.futures

    def one(i):
        with httpx.Client(base_url=server.url, timeout=60) as c:
            body = {"prompt": f"hello {i}", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            full = c.post(C, json=body).json()["choices"][0]["text"]
            events = sse_events(c, C, {**body, "stream": True})
            return full, check_chunk_shape(events, chat=False)[0]

    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        for full, streamed in ex.map(one, range(8)):
            assert full == streamed


# ---- auth and a dead engine (separate apps) ---------------------------------------------------------
def test_api_key(tiny_loaded):
    app = build_app(
        {"max_model_len": 64, "kv_cache_memory": 1 << 20, "num_threads": 1},
        loaded=tiny_loaded,
        served_model_name=MODEL,
        api_key="sekrit",
    )
    srv = ServerThread(app).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            body = {"prompt": "hi", "max_tokens": 1}
            assert_error(c.post(C, json=body), 401, code="invalid_api_key")
            assert_error(
                c.post(C, json=body, headers={"Authorization": "Bearer wrong"}),
                401,
                code="invalid_api_key",
            )
            assert_error(c.get("/v1/models"), 401)
            assert c.get("/health").status_code == 200
            assert c.get("/version").status_code == 200
            r = c.post(C, json=body, headers={"Authorization": "Bearer sekrit"})
            assert r.status_code == 200, r.text
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekrit", max_retries=0)
        assert good.models.list().data[0].id == MODEL
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    finally:
        srv.stop()


def test_dead_engine_reports_500(tiny_loaded):
    app = build_app(
        {"max_model_len": 64, "kv_cache_memory": 1 << 20, "num_threads": 1},
        loaded=tiny_loaded,
        served_model_name=MODEL,
    )
    srv = ServerThread(app).start()
    try:
        eng = srv.engine

        def broken_step():
            raise RuntimeError("boom")

        def broken_check():
            raise AssertionError("pool corrupted")

        eng.step = broken_step
        eng.block_manager.check_invariants = broken_check
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            r = c.post(C, json={"prompt": "hi", "max_tokens": 2})
            assert_error(r, 500, code="engine_error")
            t0 = time.monotonic()
            while c.get("/health").status_code != 500 and time.monotonic() - t0 < 5:
                time.sleep(0.05)
            assert_error(c.get("/health"), 500, code="engine_dead")
            assert_error(c.post(C, json={"prompt": "hi", "max_tokens": 2}), 503, code="engine_dead")
    finally:
        srv.stop()


def test_openai_client_errors(oai):
    with pytest.raises(openai.BadRequestError) as ei:
        oai.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert ei.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=MSG)
