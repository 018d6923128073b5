"""Tool calling over HTTP on the tiny random Llama: the request fields and their 400s (naming the
field, server healthy after), the shipped tool template (tools, tool calls and tool results in
the prompt, checked through /tokenize) and ``tool_choice="auto"`` answers. Grammar-forced choices
and the official-client round trip run on the bundled model (test_server_tools_smollm.py)."""

from __future__ import annotations

import json
import re

import pytest

from pagedllm.entrypoints.openai.app import build_app
from pagedllm.entrypoints.openai.tool_calls.template import tool_template
from tests.entrypoints.server_utils import (
    ServerThread,
    assert_error,
    check_chunk_shape,
    healthy,
    sse_events,
)

CH = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hello world"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def server(tiny_loaded):
    app = build_app(
        {"max_model_len": 512, "kv_cache_memory": 1 << 22, "check_invariants": True},
        loaded=tiny_loaded,
        served_model_name="tiny",
        trust_request_chat_template=True,
    )
    srv = ServerThread(app).start()
    yield srv
    srv.stop()


def _tokenized_text(client, tok, body):
    r = client.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return tok.decode(r.json()["tokens"])


BAD = [
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
        "tools",
    ),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    (  # a forced call's arguments follow a grammar, which cannot enforce uniqueItems
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}}}}],
         "tool_choice": "required"},
        "tools",
    ),
    ({"tools": "nope"}, "tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "maybe"}, "parallel_tool_calls"),
    ({"functions": [WEATHER["function"]], "tools": [WEATHER]}, "functions"),
    ({"functions": "f"}, "functions"),
    ({"functions": [{"name": ""}]}, "functions"),
    ({"functions": [WEATHER["function"]], "function_call": "required"}, "function_call"),
    ({"functions": [WEATHER["function"]], "function_call": {"name": "other"}}, "function_call"),
    ({"tools": [WEATHER], "function_call": "auto", "tool_choice": "auto"}, "function_call"),
]


@pytest.mark.parametrize("extra,param", BAD, ids=lambda x: str(x)[:50])
def test_bad_tool_fields_are_400_naming_the_field(client, server, extra, param):
    for stream in (False, True):
        body = {"messages": MSG, "max_tokens": 2, "stream": stream, **extra}
        assert_error(client.post(CH, json=body), 400, param)
    healthy(server, client)


def test_forced_parameters_are_checked_where_the_user_wrote_them(client, server):
    """The pointer names the tool and a path inside its parameters (it pointed into the
    internal array-of-calls schema: /items/anyOf/1/properties/arguments/...)."""
    bad = {"type": "object", "properties": {"city": {"type": "string", "pattern": "a^b"}}}
    tools = [WEATHER, {"type": "function", "function": {"name": "f", "parameters": bad}}]
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        body = {"messages": MSG, "max_tokens": 2, "tools": tools, "tool_choice": choice}
        err = assert_error(client.post(CH, json=body), 400, "tools")
        assert err["message"].startswith(
            "tools[1].function.parameters: 'pattern' at /properties/city is not supported"
        ), err
    # not enforced under auto (the tiny server's context holds one tool's template), even for
    # a tool named "auto"
    for name in ("f", "auto"):
        tool = {"type": "function", "function": {"name": name, "parameters": bad}}
        body = {"messages": MSG, "max_tokens": 2, "tools": [tool], "tool_choice": "auto"}
        r = client.post(CH, json=body)
        assert r.status_code == 200, r.text
    healthy(server, client)


BAD_MESSAGES = [
    [{"role": "tool", "content": "42"}],  # no tool_call_id
    [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]}],
    [{"role": "assistant", "content": None, "tool_calls": "x"}],
    [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{not json"}}],
        }
    ],
    [{"role": "user", "content": "hi", "tool_calls": []}],
    [{"role": "assistant", "content": None, "tool_calls": []}],
]


@pytest.mark.parametrize("messages", BAD_MESSAGES, ids=range(len(BAD_MESSAGES)))
def test_bad_tool_messages_are_400(client, server, messages):
    err = assert_error(
        client.post(CH, json={"messages": messages, "max_tokens": 2}), 400, "messages"
    )
    assert err["message"].startswith(("messages[0]", "messages.0"))
    assert_error(client.post("/tokenize", json={"messages": messages}), 400, "messages")
    healthy(server, client)


def _conversation(legacy: bool = False):
    call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    if legacy:
        return MSG + [
            {"role": "assistant", "content": None, "function_call": call},
            {"role": "function", "name": "get_weather", "content": '{"temp_c": 21}'},
        ]
    return MSG + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    ]


@pytest.mark.parametrize("legacy", [False, True], ids=["tools", "functions"])
def test_tool_turns_render_with_the_shipped_template(client, tiny_tokenizer, legacy):
    """The tiny template has no tools: the shipped Hermes template renders the tools, the
    assistant's call and the tool result, exactly as rendering it directly does."""
    messages = _conversation(legacy)
    text = _tokenized_text(client, tiny_tokenizer, {"messages": messages, "tools": [WEATHER]})
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert '<|im_start|>tool\n<tool_response>\n{"temp_c": 21}\n</tool_response><|im_end|>' in text
    assert json.dumps(WEATHER) in text  # the tool list, as the template writes it
    assert text.endswith("<|im_start|>assistant\n")
    dicts = [dict(m) for m in _conversation(False)]
    dicts[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    direct = tiny_tokenizer.apply_chat_template(
        dicts,
        tools=[WEATHER],
        chat_template=tool_template(),
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == direct
    # The chat endpoint accepts the conversation and renders the same prompt (without the
    # tools, whose listing does not fit the tiny model's 512 positions in its tokens).
    r = client.post(CH, json={"messages": messages, "max_tokens": 3, "return_token_ids": True})
    assert r.status_code == 200, r.text
    rendered = tiny_tokenizer.decode(r.json()["prompt_token_ids"])
    assert rendered == _tokenized_text(client, tiny_tokenizer, {"messages": messages})
    assert "<tool_response>" in rendered and "<tools>" not in rendered


def test_without_tools_the_model_template_is_kept(client, tiny_tokenizer):
    text = _tokenized_text(client, tiny_tokenizer, {"messages": MSG})
    assert text == "<s>user: hello world</s><s>assistant:"
    # tool_choice none: the tools are not shown, the prompt is the plain one
    r = client.post(
        CH,
        json={
            "messages": MSG,
            "tools": [WEATHER],
            "tool_choice": "none",
            "max_tokens": 2,
            "return_token_ids": True,
        },
    )
    assert tiny_tokenizer.decode(r.json()["prompt_token_ids"]) == text


@pytest.mark.parametrize("stream", [False, True])
def test_auto_answers_plain_text_when_no_call_is_written(client, stream):
    """The random model writes no <tool_call>: the answer is its text, finish_reason not
    tool_calls, and streaming gives the same text."""
    tools = [{"type": "function", "function": {"name": "w"}}]  # fits 512 tiny tokens
    body = {"messages": MSG, "tools": tools, "max_tokens": 8, "temperature": 0}
    r = client.post(CH, json=body)
    assert r.status_code == 200, r.text
    plain = r.json()["choices"][0]
    assert plain["finish_reason"] in ("stop", "length")
    assert "tool_calls" not in plain["message"]
    if stream:
        events = sse_events(client, CH, {**body, "stream": True})
        texts = check_chunk_shape(events)
        assert texts[0] == plain["message"]["content"]


def test_beam_search_with_a_forced_tool_choice_is_400(client, server):
    """The grammar of a forced choice cannot run with beam search: a 400 naming tool_choice
    (was a 500 from SamplingParams' ValueError)."""
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        body = {"messages": MSG, "tools": [WEATHER], "tool_choice": choice, "max_tokens": 4}
        err = assert_error(client.post(CH, json={**body, "use_beam_search": True}), 400)
        assert err["param"] == "tool_choice" and "use_beam_search" in err["message"]
    healthy(server, client)


# A short tool (the tiny tokenizer spends a token per character) whose forced JSON must write
# the key "c" inside the arguments: the stop string '"c"' cuts the call there.
CUT_TOOL = {
    "type": "function",
    "function": {
        "name": "w",
        "parameters": {
            "type": "object",
            "properties": {"c": {"type": "string"}},
            "required": ["c"],
        },
    },
}
CUT_CASES = ["required", {"type": "function", "function": {"name": "w"}}]


@pytest.mark.parametrize("choice", CUT_CASES, ids=["required", "named"])
def test_stop_string_cutting_a_forced_call_finishes_stop(client, choice):
    """A forced call cut by a stop string has unfinished arguments: finish_reason is "stop"
    (never "tool_calls", which promises arguments that parse), streamed and not, and the
    streamed fragments still concatenate to the non-streamed arguments. Uncut, the same request
    finishes "tool_calls" with arguments that parse."""
    body = {"messages": MSG, "tools": [CUT_TOOL], "tool_choice": choice, "temperature": 0}
    whole = client.post(CH, json={**body, "max_tokens": 50})
    assert whole.status_code == 200, whole.text
    choice0 = whole.json()["choices"][0]
    if choice0["finish_reason"] == "tool_calls":
        for call in choice0["message"]["tool_calls"]:
            assert "c" in json.loads(call["function"]["arguments"])
    else:  # the random model may run on in whitespace-free JSON until max_tokens
        assert choice0["finish_reason"] == "length"
    cut = {**body, "max_tokens": 50, "stop": ['"c"']}
    r = client.post(CH, json=cut)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "stop", c
    calls = c["message"].get("tool_calls") or []
    for call in calls:
        with pytest.raises(json.JSONDecodeError):
            json.loads(call["function"]["arguments"])
    events = sse_events(client, CH, {**cut, "stream": True})
    reasons = [
        ch["finish_reason"] for e in events[:-1] for ch in e["choices"] if ch["finish_reason"]
    ]
    assert reasons == ["stop"]
    args: dict[int, str] = {}
    for e in events[:-1]:
        for ch in e["choices"]:
            for tc in ch["delta"].get("tool_calls") or []:
                args[tc["index"]] = args.get(tc["index"], "") + tc["function"].get("arguments", "")
    assert [args[i] for i in sorted(args)] == [call["function"]["arguments"] for call in calls]


# pydantic writes nested models as $defs + local $refs, resolved against the parameters' root
# (short: the tiny tokenizer spends a token per character of the rendered tools).
REF_TOOL = {
    "type": "function",
    "function": {
        "name": "b",
        "parameters": {
            "$defs": {"C": {"enum": [1, 2]}},
            "type": "object",
            "properties": {"s": {"$ref": "#/$defs/C"}},
            "required": ["s"],
        },
    },
}


def test_required_accepts_parameters_with_local_refs(client, server):
    """Was a 400 "Cannot find field '$defs'": the forced array schema nests each tool's
    parameters, so their "#/..." references must be rebased."""
    body = {"messages": MSG, "tools": [REF_TOOL], "tool_choice": "required", "max_tokens": 120,
            "temperature": 0, "parallel_tool_calls": False,
            "chat_template": "{{ messages[0]['content'] }}"}  # a short prompt: room to answer
    r = client.post(CH, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    args = json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])
    assert args == {"s": 1} or args == {"s": 2}
    healthy(server, client)


# The random model writes no call on its own under "auto": this regex (structured outputs are
# allowed with "auto") makes it write a Hermes call with a 40-letter argument.
CALL_REGEX = r'<tool_call>\{"name": "w", "arguments": \{"c": "[a-z]{40}"\}\}</tool_call>'
IN_ARGS = re.compile(r'<tool_call>\{"name": "w", "arguments": \{"c": "[a-z]{1,39}')
BEFORE_ARGS = re.compile(r'<tool_call>\{"name": "w", "[a-z]*')


def _streamed(client, body):
    """(content, {index: [name, arguments]}, finish reasons) assembled from a stream."""
    content, calls, reasons = "", {}, []
    for e in sse_events(client, CH, {**body, "stream": True})[:-1]:
        for ch in e["choices"]:
            content += ch["delta"].get("content") or ""
            for tc in ch["delta"].get("tool_calls") or []:
                call = calls.setdefault(tc["index"], [tc["function"].get("name"), ""])
                call[1] += tc["function"].get("arguments", "")
            if ch["finish_reason"]:
                reasons.append(ch["finish_reason"])
    return content, calls, reasons


def test_auto_call_cut_by_max_tokens_is_length_and_no_broken_call(client, server, tiny_tokenizer):
    """A call max_tokens cuts under "auto" finishes "length" (never "tool_calls"), and the
    non-streamed message holds its text as content, not a call with arguments that do not parse
    (was: tool_calls [{"name": "w", "arguments": '{"c": "uesy'}]). A stream that sent part of
    the call keeps it (unfinished) with "length"; cut before its arguments start, the stream
    gives the same content as the non-streamed answer."""
    tools = [{"type": "function", "function": {"name": "w"}}]
    body = {"messages": MSG, "tools": tools, "tool_choice": "auto", "temperature": 0,
            "guided_regex": CALL_REGEX, "return_token_ids": True,
            "chat_template": "{{ messages[0]['content'] }}"}
    whole = client.post(CH, json={**body, "max_tokens": 200}).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls", whole
    (call,) = whole["message"]["tool_calls"]
    assert len(json.loads(call["function"]["arguments"])["c"]) == 40
    ids = whole["token_ids"]
    prefixes = [tiny_tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]
    in_args = max(k for k, t in enumerate(prefixes) if IN_ARGS.fullmatch(t))
    before_args = max(k for k, t in enumerate(prefixes) if BEFORE_ARGS.fullmatch(t))
    for k in (in_args, before_args):
        cut = {**body, "max_tokens": k}
        r = client.post(CH, json=cut)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length", choice
        assert "tool_calls" not in choice["message"], choice
        assert choice["message"]["content"] == prefixes[k]
        content, calls, reasons = _streamed(client, cut)
        assert reasons == ["length"]
        if k == before_args:
            assert (content, calls) == (prefixes[k], {})
        else:
            args = prefixes[k][prefixes[k].index('{"c"'):]
            assert content == "" and calls == {0: ["w", args]}
            with pytest.raises(json.JSONDecodeError):
                json.loads(args)
    healthy(server, client)
