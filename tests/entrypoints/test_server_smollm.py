"""The OpenAI server on the bundled SmolLM2-135M-Instruct: the server-facing cases of
/work/shared/cases (C01-C14, C17, C18, C22, C23), streaming equivalence, concurrency and
disconnects. Greedy and short outputs keep the module at a few minutes on 2 cores.

Stop strings and tokens are taken from a reference run R0 (the same greedy request without the
stop condition), never hard-coded; token ids come from the tokenizer.

Replaying the cases against an engine feature: ``PAGEDLLM_CASES_ENGINE_ARGS`` (a JSON object of
``EngineConfig`` fields, e.g. ``'{"quantization": "int8"}'`` or
``'{"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}'``) is merged into
every engine this module builds. Every property here holds under any such feature, since R0 is
taken from the same engine.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import signal
import time

import httpx
import openai
import pytest

from pagedllm.entrypoints.openai.app import build_app
from tests.entrypoints.server_utils import (
    ServerThread,
    assert_error,
    check_chunk_shape,
    sse_events,
    start_serve_process,
    wait_idle,
)

pytestmark = pytest.mark.slow

MODEL = "smol"
FEATURE_ARGS = json.loads(os.environ.get("PAGEDLLM_CASES_ENGINE_ARGS") or "{}")
C = "/v1/completions"
CH = "/v1/chat/completions"
FRANCE = "The capital of France is"


@pytest.fixture(scope="module")
def server(smollm):
    app = build_app(
        {"max_model_len": 1024, "kv_cache_memory": 96 << 20, **FEATURE_ARGS},
        loaded=smollm,
        served_model_name=MODEL,
    )
    srv = ServerThread(app).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(smollm):
    return smollm.tokenizer


def post(client, path, body, status=200):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    return r.json()


def healthy(server, client):
    post(client, C, {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert client.get("/health").status_code == 200
    wait_idle(server.engine)


def greedy(**kw):
    return {"temperature": 0, "return_token_ids": True, **kw}


def streamed_text(client, path, body, chat):
    events = sse_events(client, path, {**body, "stream": True})
    texts = check_chunk_shape(events, chat=chat)
    deltas = [
        (ch["delta"].get("content") or "") if chat else ch["text"]
        for e in events[:-1]
        for ch in e["choices"]
    ]
    return texts[0], deltas, events


@pytest.fixture(scope="module")
def r0(client):
    """R0: "The capital of France is", greedy, 32 tokens, with token ids and token strings."""
    out = post(client, C, greedy(prompt=FRANCE, max_tokens=32, logprobs=0))
    ch = out["choices"][0]
    assert len(ch["token_ids"]) >= 12, ch
    return ch


@pytest.fixture(scope="module")
def chat_r0(client):
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in a sentence."}]
    out = post(client, CH, greedy(messages=msgs, max_tokens=32))
    ch = out["choices"][0]
    return msgs, ch


def token_offsets(tok, ids):
    """Character offsets of each token in decode(ids) (for ASCII-ish text)."""
    offs, text = [], ""
    for i in range(len(ids)):
        offs.append(len(text))
        text = tok.decode(ids[: i + 1])
    return offs


# ---- basics ------------------------------------------------------------------------------------
def test_stream_equals_non_stream(client, oai):
    body = greedy(prompt=FRANCE, max_tokens=24)
    full = post(client, C, body)["choices"][0]["text"]
    s, _, _ = streamed_text(client, C, body, chat=False)
    assert s == full
    msgs = [{"role": "user", "content": "Name three colors."}]
    g = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0)
    chunks = oai.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=24, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == g.choices[0].message.content


def test_sixteen_concurrent_streams(server, client):
    prompts = [f"Write a short sentence about the number {i}." for i in range(16)]
    bodies = [greedy(messages=[{"role": "user", "content": p}], max_tokens=8) for p in prompts]
    alone = [post(client, CH, b)["choices"][0]["message"]["content"] for b in bodies]

    def run(b):
        with httpx.Client(base_url=server.url, timeout=120) as c:
            return streamed_text(c, CH, b, chat=True)[0]

    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        together = list(ex.map(run, bodies))
    assert together == alone


def test_disconnect_mid_stream_frees_blocks(server, client):
    eng = server.engine
    body = {"prompt": FRANCE, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with client.stream("POST", C, json=body) as r:
        n = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                n += 1
                if n == 3:
                    break
        assert eng.block_manager.num_free_blocks < eng.block_manager.num_blocks
    wait_idle(eng, timeout=5)


# ---- stop conditions -------------------------------------------------------------------------------
def test_c01_stop_string_ending_inside_a_token(client, tok, r0):
    ids, text = r0["token_ids"], r0["text"]
    offs = token_offsets(tok, ids)
    pieces = [tok.decode(ids[: i + 1])[offs[i] :] for i in range(len(ids))]
    cand = None
    for j in range(1, len(ids) - 2):
        for m in range(j + 1, len(ids)):
            if len(pieces[m]) >= 2:
                s = text[offs[j] : offs[m] + len(pieces[m]) - 1]
                if s and text.find(s) == offs[j]:
                    cand = (s, m)
                    break
        if cand:
            break
    assert cand, "no suitable stop string in R0"
    s, m = cand
    i = text.find(s)
    out = post(client, C, greedy(prompt=FRANCE, max_tokens=32, stop=[s]))["choices"][0]
    assert out["text"] == text[:i]
    assert out["finish_reason"] == "stop" and out["stop_reason"] == s
    assert out["token_ids"] == ids[: m + 1], "a token after the one ending the stop string"


def test_c02_streaming_never_leaks_stop_start(client, tok, r0, chat_r0):
    for path, body, ref, chat in (
        (C, greedy(prompt=FRANCE, max_tokens=32), r0, False),
        (CH, greedy(messages=chat_r0[0], max_tokens=32), chat_r0[1], True),
    ):
        ids = ref["token_ids"]
        ref_text = ref["text"] if not chat else ref["message"]["content"]
        k = 3
        while True:  # S = text of tokens k..k+2 whose first occurrence starts at token k
            s = tok.decode(ids[k : k + 3])
            if s.strip() and ref_text.find(s) >= 0 and len(ids) > k + 3:
                break
            k += 1
        i = ref_text.find(s)
        g = post(client, path, {**body, "stop": [s]})["choices"][0]
        g_text = g["message"]["content"] if chat else g["text"]
        streamed, deltas, _ = streamed_text(client, path, {**body, "stop": [s]}, chat)
        assert g_text == ref_text[:i] == streamed
        sent = 0
        for d in deltas:
            sent += len(d)
            assert sent <= i, "a delta carried text at or beyond the stop string"


def test_c03_include_stop_str_in_output(client, tok, r0):
    ids, text = r0["token_ids"], r0["text"]
    s = tok.decode(ids[4:6])
    i = text.find(s)
    assert i >= 0
    body = greedy(prompt=FRANCE, max_tokens=32, stop=[s], include_stop_str_in_output=True)
    g = post(client, C, body)["choices"][0]
    assert g["text"] == text[: i + len(s)] and g["finish_reason"] == "stop"
    streamed, _, _ = streamed_text(client, C, body, chat=False)
    assert streamed == g["text"]


def test_c04_stop_on_token_id(client, tok, r0):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert isinstance(im_end, int) and im_end >= 0
    msgs = [{"role": "user", "content": "Say hello."}]
    g = post(client, CH, greedy(messages=msgs, max_tokens=48, stop_token_ids=[im_end]))
    ch = g["choices"][0]
    assert ch["finish_reason"] == "stop"
    assert ch["token_ids"][-1] == im_end
    assert ch["message"]["content"] == tok.decode(ch["token_ids"][:-1])
    # (b) a non-special id at position k >= 3 that does not occur earlier
    ids = r0["token_ids"]
    special = set(tok.all_special_ids)
    k = next(k for k in range(3, len(ids)) if ids[k] not in ids[:k] and ids[k] not in special)
    out = post(client, C, greedy(prompt=FRANCE, max_tokens=32, stop_token_ids=[ids[k]]))
    ch = out["choices"][0]
    assert ch["token_ids"] == ids[: k + 1]
    assert ch["finish_reason"] == "stop" and ch["stop_reason"] == ids[k]


def test_c05_ignore_eos(client, tok):
    msgs = [{"role": "user", "content": "Say hi."}]
    short = post(client, CH, greedy(messages=msgs, max_tokens=64))["choices"][0]
    assert short["finish_reason"] == "stop"  # the model ends by itself without ignore_eos
    g = post(client, CH, greedy(messages=msgs, max_tokens=64, ignore_eos=True))
    ch = g["choices"][0]
    assert len(ch["token_ids"]) == 64 and g["usage"]["completion_tokens"] == 64
    assert ch["finish_reason"] == "length"
    ids = ch["token_ids"]
    k = next(k for k in range(3, 64) if ids[k] not in ids[:k])
    ch2 = post(
        client, CH, greedy(messages=msgs, max_tokens=64, ignore_eos=True, stop_token_ids=[ids[k]])
    )["choices"][0]
    assert ch2["token_ids"] == ids[: k + 1] and ch2["finish_reason"] == "stop"


def test_c06_min_tokens_holds_back_stops(client, tok, r0):
    eos = set(tok.all_special_ids)
    stop = tok.decode(r0["token_ids"][1:2])
    body = greedy(prompt=FRANCE, max_tokens=20, min_tokens=20, stop=[stop])
    ch = post(client, C, body)["choices"][0]
    assert len(ch["token_ids"]) == 20 and ch["finish_reason"] == "length"
    assert not eos & set(ch["token_ids"][:20])
    # a chat that would end at once still runs min_tokens tokens, then EOS applies again
    msgs = [{"role": "user", "content": "Say hi."}]
    ch = post(client, CH, greedy(messages=msgs, max_tokens=200, min_tokens=5))["choices"][0]
    assert len(ch["token_ids"]) >= 5 and not eos & set(ch["token_ids"][:5])
    assert ch["finish_reason"] == "stop" and len(ch["token_ids"]) < 200


# ---- detokenization ----------------------------------------------------------------------------------
def test_c07_multibyte_characters(client, tok):
    msgs = [{"role": "user", "content": "Repeat exactly: 🌶️ 🫠 龜 ñ ď 客单价"}]
    body = greedy(messages=msgs, max_tokens=64, logprobs=True)
    g = post(client, CH, body)["choices"][0]
    text = g["message"]["content"]
    assert text == tok.decode(g["token_ids"], skip_special_tokens=True)
    streamed, deltas, _ = streamed_text(client, CH, body, chat=True)
    assert streamed == text
    pos = 0
    for d in deltas:
        d.encode("utf-8")  # whole code points: no lone surrogates
        for j, ch in enumerate(d):
            if ch == "\ufffd":
                assert text[pos + j] == "\ufffd"
        pos += len(d)
    # the chat logprob bytes of the tokens add up to the text's UTF-8 (bar the special token)
    content = g["logprobs"]["content"]
    assert len(content) == len(g["token_ids"])
    raw = b"".join(
        bytes(e["bytes"])
        for e, t in zip(content, g["token_ids"])
        if t not in set(tok.all_special_ids)
    )
    assert raw.decode("utf-8", "replace") == text


# ---- request edge cases ----------------------------------------------------------------------------
def test_c08_empty_prompt(client, server):
    for prompt in ("", [""], []):
        assert_error(client.post(C, json={"prompt": prompt}), 400, "prompt")
    r = post(client, CH, greedy(messages=[{"role": "user", "content": ""}], max_tokens=4))
    assert r["usage"]["prompt_tokens"] > 0
    healthy(server, client)


def test_c09_context_length(smollm):
    app = build_app(
        {"max_model_len": 128, "kv_cache_memory": 8 << 20, **FEATURE_ARGS},
        loaded=smollm,
        served_model_name=MODEL,
    )
    srv = ServerThread(app).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            tid = smollm.tokenizer(" hello").input_ids[0]
            for n in (129, 128):
                assert_error(
                    c.post(C, json={"prompt": [tid] * n}), 400, "prompt", "context_length_exceeded"
                )
            r = c.post(C, json={"prompt": [tid] * 127, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 1
            assert r.json()["choices"][0]["finish_reason"] == "length"
            err = assert_error(
                c.post(C, json={"prompt": [tid] * 120, "max_tokens": 16}),
                400,
                "max_tokens",
                "context_length_exceeded",
            )
            assert "context" in err["message"] or "max_model_len" in err["message"]
            assert c.post(C, json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
            assert c.get("/health").status_code == 200
            wait_idle(srv.engine)
    finally:
        srv.stop()


def test_c10_echo_max_tokens_zero(client, tok):
    prompt = "Hello, my name is"
    n = len(tok(prompt).input_ids)
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    g = post(client, C, body)
    ch = g["choices"][0]
    assert ch["text"] == prompt and g["usage"]["completion_tokens"] == 0
    lps = ch["logprobs"]["token_logprobs"]
    assert len(lps) == n and lps[0] is None
    assert all(math.isfinite(x) and x <= 0 for x in lps[1:])
    streamed, _, events = streamed_text(client, C, body, chat=False)
    assert streamed == prompt
    s_lps = sum((e["choices"][0]["logprobs"]["token_logprobs"] for e in events[:-1]), [])
    assert s_lps == lps


def test_c11_echo_logprobs_alignment(client):
    body = {"prompt": "Hello, my name is", "max_tokens": 4, "echo": True, "logprobs": 1}
    g = post(client, C, {**body, "temperature": 0})
    lp = g["choices"][0]["logprobs"]
    total = g["usage"]["prompt_tokens"] + g["usage"]["completion_tokens"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert len(lp[key]) == total, key
    offs = lp["text_offset"]
    assert offs[0] == 0 and all(b >= a for a, b in zip(offs, offs[1:]))
    n_prompt = g["usage"]["prompt_tokens"]
    for i in range(n_prompt, total):  # greedy: the chosen token is the most likely one
        assert lp["token_logprobs"][i] == pytest.approx(max(lp["top_logprobs"][i].values()))
    assert g["choices"][0]["text"].startswith("Hello, my name is")


# ---- sampling -------------------------------------------------------------------------------------------
def test_c12_n_with_seed(client):
    body = {"prompt": FRANCE, "n": 4, "seed": 1234, "temperature": 1, "max_tokens": 24}
    a = post(client, C, body)
    texts = {c["index"]: c["text"] for c in a["choices"]}
    assert set(texts) == {0, 1, 2, 3}
    assert len(set(texts.values())) > 1
    b = post(client, C, body)
    assert {c["index"]: c["text"] for c in b["choices"]} == texts
    events = sse_events(client, C, {**body, "stream": True})
    assert check_chunk_shape(events, n=4, chat=False) == texts
    no_seed = {k: v for k, v in body.items() if k != "seed"}
    x, y = post(client, C, no_seed), post(client, C, no_seed)
    assert [c["text"] for c in x["choices"]] != [c["text"] for c in y["choices"]]


def test_c13_logprobs_shape_and_meaning(client):
    msgs = [{"role": "user", "content": "Name a fruit."}]
    g = post(client, CH, greedy(messages=msgs, max_tokens=8, logprobs=True))
    content = g["choices"][0]["logprobs"]["content"]
    assert len(content) == g["usage"]["completion_tokens"]
    for e in content:
        assert e["top_logprobs"] == []
        assert e["bytes"] == list(e["token"].encode("utf-8"))
        assert e["logprob"] <= 0
    c = post(client, C, greedy(prompt=FRANCE, max_tokens=8, logprobs=0))["choices"][0]
    lps = c["logprobs"]["token_logprobs"]
    assert len(lps) == len(c["token_ids"]) and all(math.isfinite(x) and x <= 0 for x in lps)
    tops = []
    for t in (0.5, 1.5):
        r = post(
            client,
            CH,
            {
                "messages": msgs,
                "max_tokens": 1,
                "temperature": t,
                "seed": 3,
                "logprobs": True,
                "top_logprobs": 3,
            },
        )
        tops.append(r["choices"][0]["logprobs"]["content"][0]["top_logprobs"])
    assert [x["token"] for x in tops[0]] == [x["token"] for x in tops[1]]
    for a, b in zip(tops[0], tops[1]):
        assert a["logprob"] <= 0 and abs(a["logprob"] - b["logprob"]) < 1e-4


def test_c14_penalties(client, tok):
    prompt = "Paris Paris Paris Paris Paris"
    (paris,) = tok(" Paris").input_ids
    # Make " Paris" the greedy choice by a margin of 1 logit (raw logprob gap + 1) so that the
    # effect of each penalty on it is visible in the chosen token.
    probe = post(client, C, greedy(prompt=prompt, max_tokens=1, logprobs=1))["choices"][0]
    top_lp = max(probe["logprobs"]["top_logprobs"][0].values())
    # log P(" Paris" | prompt): the last prompt logprob of the prompt with one more " Paris"
    echo = {"prompt": prompt + " Paris", "max_tokens": 0, "echo": True, "logprobs": 0}
    lp_paris = post(client, C, echo)["choices"][0]["logprobs"]["token_logprobs"][-1]
    margin = top_lp - lp_paris + 1.0
    base = greedy(prompt=prompt, max_tokens=1, logit_bias={str(paris): margin})
    assert post(client, C, base)["choices"][0]["token_ids"] == [paris]
    # presence / frequency count the OUTPUT only: nothing generated yet, nothing changes
    for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        assert post(client, C, {**base, **kw})["choices"][0]["token_ids"] == [paris], kw
    # the repetition penalty counts the prompt too: " Paris" is lowered below another token
    rp = post(client, C, {**base, "repetition_penalty": 2.0})["choices"][0]["token_ids"]
    assert rp != [paris]
    # over 16 tokens: the first token is unchanged, later ones see the generated " Paris"
    body16 = {**base, "max_tokens": 16, "ignore_eos": True}
    plain = post(client, C, body16)["choices"][0]["token_ids"]
    pen = post(client, C, {**body16, "presence_penalty": 2.0})["choices"][0]["token_ids"]
    assert plain[0] == pen[0] == paris
    assert pen.count(paris) < plain.count(paris)


# ---- streaming protocol -----------------------------------------------------------------------------------
def core(usage):
    """Usage without prompt_tokens_details (cached tokens differ between repeated requests)."""
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def test_c17_usage_in_streams(client):
    msgs = [{"role": "user", "content": "Count to five."}]
    body = {"messages": msgs, "n": 2, "max_tokens": 12, "temperature": 0.8, "seed": 5}
    full = post(client, CH, body)
    for opts in (None, {}):
        b = {**body, "stream": True, **({"stream_options": opts} if opts is not None else {})}
        events = sse_events(client, CH, b)
        check_chunk_shape(events, n=2)
        assert all("usage" not in e or e["usage"] is None for e in events[:-1])
        assert all("usage" not in e for e in events[:-1])
    events = sse_events(
        client, CH, {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    check_chunk_shape(events, n=2)
    assert all(e["usage"] is None for e in events[:-2])
    last = events[-2]
    assert last["choices"] == [] and core(last["usage"]) == core(full["usage"])


def test_c17_usage_in_streams_n1(client):
    msgs = [{"role": "user", "content": "Count to five."}]
    body = greedy(messages=msgs, max_tokens=12)
    full = post(client, CH, body)
    for extra in ({}, {"stream_options": {}}, {"stream_options": {"include_usage": False}}):
        events = sse_events(client, CH, {**body, "stream": True, **extra})
        assert all("usage" not in e for e in events[:-1])
    events = sse_events(
        client, CH, {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert all(e["usage"] is None for e in events[:-2])
    assert events[-2]["choices"] == [] and core(events[-2]["usage"]) == core(full["usage"])


def test_c18_chunk_shape(client):
    msgs = [{"role": "user", "content": "Say hello."}]
    for path, body, chat in (
        (CH, greedy(messages=msgs, max_tokens=10), True),
        (C, greedy(prompt=FRANCE, max_tokens=10), False),
    ):
        events = sse_events(client, path, {**body, "stream": True})
        check_chunk_shape(events, chat=chat)
        first = events[0]["choices"][0]
        if chat:
            assert first["delta"]["role"] == "assistant"


# ---- validation --------------------------------------------------------------------------------------------
def test_c22_validation_smollm(client, server):
    msgs = [{"role": "user", "content": "hi"}]
    for path, extra, param in (
        (C, {"temperature": -1}, "temperature"),
        (C, {"top_p": 1.5}, "top_p"),
        (C, {"logprobs": 21}, "logprobs"),
        (CH, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (CH, {"top_logprobs": 2}, "top_logprobs"),
        (C, {"best_of": 1, "n": 2}, "best_of"),
        (C, {"stop": [""]}, "stop"),
    ):
        body = {"prompt": "hi"} if path == C else {"messages": msgs}
        assert_error(client.post(path, json={**body, **extra}), 400, param)
    assert_error(client.post(CH, json={"messages": []}), 400, "messages")
    assert_error(client.post(CH, json={"model": "x", "messages": msgs}), 404, "model")
    assert post(client, C, {"prompt": "hi", "stop": "\n", "max_tokens": 2})
    healthy(server, client)


def test_c23_token_ids_outside_vocab(client, server):
    v = server.engine.vocab_size
    for extra, param in (
        ({"prompt": "hi", "stop_token_ids": [v], "min_tokens": 1}, "stop_token_ids"),
        ({"prompt": [v]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": "hi", "logit_bias": {str(v): 5}}, "logit_bias"),
    ):
        assert_error(client.post(C, json={"max_tokens": 2, **extra}), 400, param)
    healthy(server, client)


# ---- graceful shutdown of `pagedllm serve` ---------------------------------------------------------------------
def test_serve_cli_sigterm_exits_zero(tmp_path):
    proc, url = start_serve_process(
        [
            "--max-model-len",
            "512",
            "--kv-cache-memory",
            str(32 << 20),
            "--served-model-name",
            MODEL,
            "--shutdown-grace-period",
            "0",  # abort at once (the drain is tested in test_overload.py)
        ]
    )
    try:
        body = {"prompt": FRANCE, "max_tokens": 500, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=url, timeout=60) as c, c.stream("POST", C, json=body) as r:
            lines = []
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 2:
                    proc.send_signal(signal.SIGTERM)
            t_sig = time.monotonic()
        assert lines[-1] == "data: [DONE]"
        assert "error" in json.loads(lines[-2][len("data: ") :])
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - t_sig < 20
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
