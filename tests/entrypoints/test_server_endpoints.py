"""Issue 23 item 3 on the tiny random Llama: beam search over HTTP (equal to ``LLM.generate``
with the same beam parameters), a per-request ``chat_template`` / ``chat_template_kwargs``, and
``/v1/responses`` through the official ``openai`` client (the text equals ``LLM.chat`` on the same
conversation, greedy; the streamed events concatenate to the same text; a
``previous_response_id`` chain continues the stored conversation, instructions not carried; GET
returns a stored response; unknown ids are 404; the store is a bounded LRU). One slow test runs
``/v1/responses`` on the bundled SmolLM2.

Every test ends with the engine idle and every KV block free (autouse fixture); error cases end
with ``healthy`` (a normal request succeeds, /health is 200).
"""

from __future__ import annotations

import openai
import pytest

from pagedllm.entrypoints.llm import LLM
from pagedllm.entrypoints.openai.app import build_app
from pagedllm.entrypoints.openai.serving_responses import ResponseStore
from pagedllm.sampling_params import SamplingParams
from tests.entrypoints.server_utils import ServerThread, assert_error, healthy

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
RESP = "/v1/responses"
ENGINE_ARGS = {
    "max_model_len": 128,
    "kv_cache_memory": 1 << 22,
    "check_invariants": True,
    "num_threads": 1,
    "dtype": "float32",
}


@pytest.fixture(scope="module")
def server(tiny_loaded):
    app = build_app(
        dict(ENGINE_ARGS),
        loaded=tiny_loaded,
        served_model_name=["tiny", "tiny-alias"],
        trust_request_chat_template=True,
    )
    srv = ServerThread(app).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ref_llm(tiny_loaded):
    llm = LLM(loaded=tiny_loaded, **ENGINE_ARGS)
    yield llm
    llm.engine.shutdown()


def official_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ok(client, path: str, body: dict) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


# ---- beam search ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "beam",
    [
        {"best_of": 3, "n": 2},
        {"best_of": 4, "n": 1, "length_penalty": 0.5, "early_stopping": True},
        {"n": 2, "early_stopping": "never"},  # width = n when best_of is not given
    ],
)
def test_completion_beam_search_equals_offline(client, ref_llm, beam):
    prompt = "paged attention stores keys"
    body = {"prompt": prompt, "max_tokens": 6, "use_beam_search": True, "temperature": 0}
    body.update(beam)
    got = ok(client, CMPL, {**body, "return_token_ids": True})
    params = SamplingParams(
        n=beam["n"],
        best_of=beam.get("best_of"),
        use_beam_search=True,
        temperature=0.0,
        max_tokens=6,
        length_penalty=beam.get("length_penalty", 1.0),
        early_stopping=beam.get("early_stopping", False),
    )
    (want,) = ref_llm.generate(prompt, params, use_tqdm=False)
    assert len(got["choices"]) == beam["n"] == len(want.outputs)
    for ch, c in zip(got["choices"], want.outputs, strict=True):
        assert ch["token_ids"] == c.token_ids
        assert ch["text"] == c.text
    # Beams differ (else beam search was ignored and greedy copies came back).
    if beam["n"] > 1:
        assert got["choices"][0]["token_ids"] != got["choices"][1]["token_ids"]


def test_chat_beam_search_equals_offline(client, ref_llm):
    messages = [{"role": "user", "content": "hello world"}]
    got = ok(
        client,
        CHAT,
        {"messages": messages, "max_tokens": 5, "use_beam_search": True, "best_of": 3, "n": 2},
    )
    params = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0, max_tokens=5)
    (want,) = ref_llm.chat(messages, params, use_tqdm=False)
    assert [c["message"]["content"] for c in got["choices"]] == [c.text for c in want.outputs]
    n_out = sum(len(c.token_ids) for c in want.outputs)
    assert got["usage"]["completion_tokens"] == n_out


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"stream": True}, "stream"),
        ({"stop": ["x"]}, "stop"),
        ({"temperature": 0.7}, "temperature"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
        ({"length_penalty": "long"}, "length_penalty"),
    ],
)
def test_beam_search_bad_values_are_400(client, server, extra, param):
    body = {"prompt": "hi", "max_tokens": 3, "use_beam_search": True, "best_of": 2, **extra}
    assert_error(client.post(CMPL, json=body), 400, param)
    healthy(server, client)


def test_beam_search_logprobs_and_echo(client, server):
    """Beam search with logprobs, echo and prompt logprobs (echo + logprobs was a 500, then a
    400): every generated token has its logprob."""
    body = {"prompt": "hi", "max_tokens": 3, "use_beam_search": True, "best_of": 2, "n": 2,
            "temperature": 0, "ignore_eos": True, "logprobs": 1}
    got = ok(client, CMPL, body)
    for ch in got["choices"]:
        lp = ch["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 3
        assert all(isinstance(v, float) for v in lp["token_logprobs"])
    echo = ok(client, CMPL, {**body, "echo": True, "n": 1})["choices"][0]
    assert echo["text"].startswith("hi") and echo["logprobs"]["token_logprobs"][0] is None
    assert echo["logprobs"]["token_logprobs"][-3:] == got["choices"][0]["logprobs"]["token_logprobs"]
    only_echo = ok(client, CMPL, {**body, "echo": True, "max_tokens": 0})
    assert [c["text"] for c in only_echo["choices"]] == ["hi", "hi"]
    chat = {"messages": MESSAGES_HI, "max_tokens": 3, "use_beam_search": True, "best_of": 2,
            "logprobs": True, "top_logprobs": 2, "ignore_eos": True}
    content = ok(client, CHAT, chat)["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(e["top_logprobs"]) == 2 for e in content)
    healthy(server, client)


MESSAGES_HI = [{"role": "user", "content": "hi"}]


# ---- per-request chat template -------------------------------------------------------------------
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] | upper }}]{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ reply_tag }}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "hello world"}]


def test_chat_template_per_request(client, server):
    tok = server.engine.tokenizer
    want = tok("[USER]hello world<s>assistant:", add_special_tokens=False).input_ids
    extra = {"chat_template": TEMPLATE, "chat_template_kwargs": {"reply_tag": "<s>assistant:"}}
    got = ok(client, "/tokenize", {"messages": MESSAGES, **extra})
    assert got["tokens"] == want
    body = {"messages": MESSAGES, "max_tokens": 2, "return_token_ids": True, **extra}
    assert ok(client, CHAT, body)["prompt_token_ids"] == want
    # Without it the model's own template is used again.
    own = ok(client, CHAT, {"messages": MESSAGES, "max_tokens": 2, "return_token_ids": True})
    assert own["prompt_token_ids"] == tok.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    # chat_template_kwargs alone reach the model's template (an unused variable is harmless).
    kw = ok(client, CHAT, {**body, "chat_template": None, "chat_template_kwargs": {"x": 1}})
    assert kw["prompt_token_ids"] == own["prompt_token_ids"]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"chat_template": "{% for m in messages %}"}, "chat_template"),  # syntax error
        ({"chat_template": "{{ raise_exception('no') }}"}, "chat_template"),
        ({"chat_template": "{{ messages[5]['content'] | upper }}"}, "chat_template"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": ["not", "a", "dict"]}, "chat_template_kwargs"),
        ({"chat_template": 5}, "chat_template"),
    ],
)
def test_chat_template_errors_are_400(client, server, extra, param):
    body = {"messages": MESSAGES, "max_tokens": 2, **extra}
    assert_error(client.post(CHAT, json=body), 400, param)
    healthy(server, client)


def test_a_request_template_needs_a_trusting_server(client, server):
    """A template is code the server runs ("x" * 20000000 rendered for seconds and held up
    /health): refused unless the server was started with --trust-request-chat-template."""
    serving = server.app.state.serving
    serving.trust_request_chat_template = False
    try:
        for path in (CHAT, "/tokenize"):
            r = client.post(path, json={"messages": MESSAGES, "max_tokens": 2,
                                        "chat_template": TEMPLATE})
            assert_error(r, 400, "chat_template")
            assert "--trust-request-chat-template" in r.json()["error"]["message"]
        # chat_template_kwargs alone stay allowed: they only feed the server's own template
        ok(client, CHAT, {"messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {"x": 1}})
    finally:
        serving.trust_request_chat_template = True
    r = client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 2, "chat_template": " "})
    assert_error(r, 400, "chat_template")
    healthy(server, client)


def test_retrieve_model(client, server):
    """Each served name's card is its /v1/models entry, unchanged: the alias's too, whose root
    is the model it serves (was the alias itself), with vLLM's ``parent`` (was missing) and
    the time the server started as ``created`` (was the time of each call)."""
    created = server.app.state.serving.created
    listed = client.get("/v1/models").json()["data"]
    assert listed == [
        {"id": name, "object": "model", "created": created, "owned_by": "pagedllm",
         "root": "tiny", "parent": None, "max_model_len": 128}
        for name in ("tiny", "tiny-alias")
    ]
    for entry in listed:
        r = client.get(f"/v1/models/{entry['id']}")
        assert r.status_code == 200, r.text
        assert r.json() == entry
    err = assert_error(client.get("/v1/models/other"), 404, "model", "model_not_found")
    assert "`other`" in err["message"]
    oai = official_client(server)
    assert oai.models.retrieve("tiny-alias").id == "tiny-alias"
    r = client.post(CMPL, json={"model": "tiny-alias", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == "tiny", r.text


# ---- /v1/responses -------------------------------------------------------------------------------
def chat_ref(llm: LLM, messages: list[dict], max_tokens: int):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return llm.chat(messages, params, use_tqdm=False)[0]


def stream_events(oai, **kw) -> list:
    with oai.responses.create(stream=True, **kw) as stream:
        return list(stream)


def test_response_text_stream_and_chain(server, ref_llm):
    oai = official_client(server)
    kw = {"model": "tiny", "max_output_tokens": 6, "temperature": 0}
    first = oai.responses.create(input="hello world", instructions="be brief", **kw)
    want = chat_ref(
        ref_llm,
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}],
        6,
    )
    assert first.object == "response" and first.id.startswith("resp_")
    assert first.output_text == want.outputs[0].text
    assert first.status == (
        "incomplete" if want.outputs[0].finish_reason == "length" else "completed"
    )
    if first.status == "incomplete":
        assert first.incomplete_details.reason == "max_output_tokens"
    assert first.usage.input_tokens == len(want.prompt_token_ids)
    assert first.usage.output_tokens == len(want.outputs[0].token_ids)
    assert first.instructions == "be brief"

    # Streamed: the Responses events, in order, concatenating to the same text.
    events = stream_events(oai, input="hello world", instructions="be brief", **kw)
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert types[-1] == f"response.{first.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == first.output_text == events[-4].text
    assert events[-1].response.output_text == first.output_text

    # The chain: previous conversation + its reply + the new input; instructions not carried.
    second = oai.responses.create(input="and more", previous_response_id=first.id, **kw)
    conv = [
        {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "and more"},
    ]
    want2 = chat_ref(ref_llm, conv, 6)
    assert second.output_text == want2.outputs[0].text
    assert second.usage.input_tokens == len(want2.prompt_token_ids)
    assert second.previous_response_id == first.id
    # A message-list input and GET of a stored response.
    third = oai.responses.create(
        input=[{"role": "user", "content": [{"type": "input_text", "text": "hello world"}]}], **kw
    )
    assert third.output_text == chat_ref(ref_llm, conv[:1], 6).outputs[0].text
    got = oai.responses.retrieve(third.id)
    assert got.id == third.id and got.output_text == third.output_text


def test_unknown_and_unstored_ids_are_404(client, server):
    oai = official_client(server)
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model="tiny", input="hi", previous_response_id="resp_nope")
    assert e.value.body["code"] == "previous_response_not_found"
    assert e.value.body["param"] == "previous_response_id"
    assert_error(client.get(f"{RESP}/resp_nope"), 404)
    r = oai.responses.create(model="tiny", input="hi", store=False, max_output_tokens=2)
    assert_error(client.get(f"{RESP}/{r.id}"), 404)
    healthy(server, client)


def test_store_is_a_bounded_lru():
    store = ResponseStore(capacity=2)
    for rid in ("a", "b"):
        store.put({"id": rid}, [{"role": "user", "content": rid}])
    assert store.get("a") is not None  # "a" is now the most recent: "b" goes first
    store.put({"id": "c"}, [])
    assert len(store) == 2 and store.get("b") is None
    assert store.get("a") == ({"id": "a"}, [{"role": "user", "content": "a"}])
    with pytest.raises(ValueError, match="^capacity"):
        ResponseStore(0)


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": "x " * 300}, "input"),  # longer than max_model_len
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "max_output_tokens": 1000}, "max_output_tokens"),
        ({"input": "hi", "temperature": 3}, "temperature"),
        ({"input": "hi", "top_p": 0}, "top_p"),
        ({"input": "hi", "tools": [{"type": "function", "name": "f"}]}, "tools"),
        ({"input": "hi", "text": {"format": {"type": "json_object"}}}, "text"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "stream": "sometimes"}, "stream"),
        ({"input": "hi", "cache_salt": ""}, "cache_salt"),  # (the field was ignored)
        ({"input": "hi", "cache_salt": 5}, "cache_salt"),
    ],
)
def test_responses_bad_values_are_400(client, server, body, param):
    r = client.post(RESP, json=body)
    assert_error(r, 400, param)
    if "max_output_tokens" in body:  # the engine's max_tokens, named as the request does
        msg = r.json()["error"]["message"]
        assert msg.startswith("max_output_tokens") and "max_tokens" not in msg, msg
    healthy(server, client)


def test_responses_cache_salt_separates_prefix_cache_hits(client, server):
    body = {"input": "salted responses " * 4, "max_output_tokens": 1, "temperature": 0}

    def cached(**extra):
        got = ok(client, RESP, {**body, **extra})
        return got["usage"]["input_tokens_details"]["cached_tokens"]

    cached()
    assert cached() > 0
    assert cached(cache_salt="r1") == 0
    assert cached(cache_salt="r1") > 0
    healthy(server, client)


@pytest.mark.slow
def test_responses_official_client_bundled_model(smollm):
    """The bundled SmolLM2 behind a real server: a non-streamed and a streamed response through
    the official client give the same greedy text, and a follow-up continues the conversation."""
    app = build_app(
        {"max_model_len": 512, "kv_cache_memory": 1 << 26, "num_threads": 2},
        loaded=smollm,
    )
    srv = ServerThread(app).start()
    try:
        oai = official_client(srv)
        kw = {"model": "SmolLM2-135M-Instruct", "max_output_tokens": 12, "temperature": 0}
        q = "What is the capital of France?"
        r = oai.responses.create(input=q, instructions="Answer in one word.", **kw)
        assert r.status in ("completed", "incomplete") and r.output_text.strip()
        assert "Paris" in r.output_text
        events = stream_events(oai, input=q, instructions="Answer in one word.", **kw)
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == r.output_text == events[-1].response.output_text
        follow = oai.responses.create(input="And of Italy?", previous_response_id=r.id, **kw)
        assert follow.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens
        assert follow.output_text.strip()
    finally:
        srv.stop()


def test_default_max_tokens_fits_a_pool_smaller_than_the_context(tiny_loaded):
    """A pool of 6 x 16 = 96 tokens under max_model_len 128: a 90-token prompt without
    max_tokens gets the 6 tokens the pool leaves (was a 400 blaming max_tokens, which the
    client never sent); an explicit max_tokens over the pool stays a 400."""
    import httpx

    from tests.entrypoints.server_utils import start_tiny_server

    srv = start_tiny_server(tiny_loaded, num_gpu_blocks_override=6, block_size=16)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            prompt = [(7 * i) % 300 + 3 for i in range(90)]
            body = {"prompt": prompt, "temperature": 0, "ignore_eos": True}
            choice = ok(c, CMPL, body)["choices"][0]
            assert choice["finish_reason"] == "length"
            assert ok(c, CMPL, body)["usage"]["completion_tokens"] == 6
            assert_error(c.post(CMPL, json={**body, "max_tokens": 16}), 400, "max_tokens")
            # Two samples do not fit even one token each: blamed on n, not on the default.
            assert_error(c.post(CMPL, json={**body, "n": 2}), 400, "n")
            r = c.post("/v1/responses", json={"input": [{"role": "user", "content": []}]})
            assert_error(r, 400, "input")
            healthy(srv, c)
    finally:
        srv.stop()
