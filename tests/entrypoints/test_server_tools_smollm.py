"""Tool-calling round trips through the official ``openai`` client on the bundled SmolLM2-135M:
``tool_choice="required"`` and a named function are enforced by the grammar, so the arguments
parse and validate against the function's parameters; streamed deltas concatenate to exactly the
non-streamed call (greedy, so both runs write the same text); the tool result flows into the
next prompt (checked through /tokenize and the chat prompt's token ids)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.entrypoints import test_server_smollm as smol_server
from tests.entrypoints.server_utils import healthy

# The server (and client) fixtures of the SmolLM2 server tests, one server for this module.
server = smol_server.server
oai = smol_server.oai
MODEL = smol_server.MODEL

pytestmark = pytest.mark.slow

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 40}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _ask(oai, tool_choice, stream, **kw):
    return oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=tool_choice,
        temperature=0,
        max_tokens=120,
        stream=stream,
        **kw,
    )


def _streamed_calls(stream) -> tuple[list[dict], str | None]:
    """Calls assembled from the deltas (id, type and name only in a call's first delta)."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name, d
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and d.function.name is None, d
                calls[d.index]["arguments"] += d.function.arguments or ""
            if ch.finish_reason is not None:
                finish = ch.finish_reason
    return [calls[i] for i in sorted(calls)], finish


def _check_calls(calls: list[dict], names: set[str]) -> None:
    assert calls
    for c in calls:
        assert c["name"] in names
        jsonschema.validate(json.loads(c["arguments"]), PARAMS[c["name"]])


@pytest.mark.parametrize(
    "tool_choice,names,parallel",
    [
        ("required", {"get_weather", "get_time"}, True),
        ("required", {"get_weather", "get_time"}, False),
        (NAMED, {"get_weather"}, True),
    ],
    ids=["required", "required-single", "named"],
)
def test_forced_calls_parse_validate_and_stream_identically(
    oai, server, tool_choice, names, parallel
):
    r = _ask(oai, tool_choice, False, parallel_tool_calls=parallel)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    full = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in choice.message.tool_calls
    ]
    _check_calls(full, names)
    if not parallel:
        assert len(full) == 1
    streamed, finish = _streamed_calls(_ask(oai, tool_choice, True, parallel_tool_calls=parallel))
    assert finish == "tool_calls"
    strip = [{k: c[k] for k in ("name", "arguments")} for c in full]
    assert [{k: c[k] for k in ("name", "arguments")} for c in streamed] == strip
    assert all(c["id"].startswith("call_") for c in full + streamed)
    healthy(server, httpx.Client(base_url=server.url, timeout=60))


def test_tool_result_flows_into_the_next_prompt(oai, server, smollm):
    r = _ask(oai, NAMED, False)
    call = r.choices[0].message.tool_calls[0]
    result = '{"temperature": 21, "unit": "celsius", "sky": "clear"}'
    follow = MESSAGES + [
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    answer = oai.chat.completions.create(
        model=MODEL,
        messages=follow,
        tools=TOOLS,
        temperature=0,
        max_tokens=8,
        extra_body={"return_token_ids": True},
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt_ids = answer.model_extra["prompt_token_ids"]
    with httpx.Client(base_url=server.url, timeout=60) as client:
        tokenized = client.post("/tokenize", json={"messages": follow, "tools": TOOLS}).json()
    assert tokenized["tokens"] == prompt_ids
    text = smollm.tokenizer.decode(prompt_ids)
    assert f"<|im_start|>tool\n<tool_response>\n{result}\n</tool_response><|im_end|>" in text
    args = json.loads(call.function.arguments)
    assert json.dumps({"name": "get_weather", "arguments": args}) in text
    assert text.endswith("<|im_start|>assistant\n")


def test_required_with_n2_sampled_gives_valid_calls_in_every_choice(oai, server):
    r = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        n=2,
        temperature=0.8,
        seed=0,
        max_tokens=120,
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        calls = [
            {"name": c.function.name, "arguments": c.function.arguments}
            for c in choice.message.tool_calls
        ]
        _check_calls(calls, {"get_weather", "get_time"})
