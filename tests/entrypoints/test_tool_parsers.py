"""Tool-call parsers on scripted model outputs (a 135M model may never call a tool on its own):
each format's non-streamed content and calls, streaming in random chunkings equal to the
non-streamed answer, the JSON scanner, and the schemas the grammar enforces."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.tool_calls.json_scan import Malformed, scan_call, value_end
from pagedllm.entrypoints.openai.tool_calls.parsers import (
    HermesToolParser,
    Llama3ToolParser,
    MistralToolParser,
    NamedToolParser,
    RequiredToolParser,
    ToolCallStream,
    parser_for_template,
)
from pagedllm.entrypoints.openai.tool_calls.schema import forced_schema, resolve_tools


def _declared(parser_cls, *names):
    """A parser of ``parser_cls`` for a request declaring the functions ``names``."""
    parser = parser_cls()
    parser.declared = frozenset(names)
    return parser


W = '{"city": "Paris, \\"FR\\"", "days": [1, 2.5e1], "ok": true, "x": null}'

# (parser, model output, expected content, expected [(name, arguments)])
CASES = [
    (
        HermesToolParser(),
        f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>',
        None,
        [("get_weather", W)],
    ),
    (
        HermesToolParser(),
        'Let me check.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>{"arguments": {"q": "<tool_call>"}, "name": "b"}</tool_call>\n',
        "Let me check.",
        [("a", "{}"), ("b", '{"q": "<tool_call>"}')],
    ),
    (
        HermesToolParser(),
        "Plain answer with < and <tool and a trailing newline\n",
        "Plain answer with < and <tool and a trailing newline\n",
        [],
    ),
    (
        HermesToolParser(),
        '<tool_call>{"name": "f", "arguments": {"a": [1, {"b": "}"}]}}',
        None,
        [("f", '{"a": [1, {"b": "}"}]}')],
    ),  # missing closing tag at the end: forgiven
    (
        HermesToolParser(),
        'x <tool_call>{"nam": oops}</tool_call> y',
        'x <tool_call>{"nam": oops}</tool_call> y',
        [],
    ),  # malformed: stays content
    (
        HermesToolParser(),
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
        None,
        [("f", '{"a": 1}')],
    ),  # arguments given as a JSON-encoded string
    (
        Llama3ToolParser(),
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("get_weather", '{"city": "Paris"}')],
    ),
    (
        Llama3ToolParser(),
        '<|python_tag|>{"name": "a", "parameters": {"n": 1}}; {"name": "b", "parameters": {}}',
        None,
        [("a", '{"n": 1}'), ("b", "{}")],
    ),
    (
        Llama3ToolParser(),
        'Sure <|python_tag|>{"name": "a", "parameters": {"n": -1.5}}',
        "Sure",
        [("a", '{"n": -1.5}')],
    ),
    (
        Llama3ToolParser(),
        '{"answer": 42} is JSON but no call',
        '{"answer": 42} is JSON but no call',
        [],
    ),
    (
        MistralToolParser(),
        '[TOOL_CALLS] [{"name": "a", "arguments": {"k": "v"}}, '
        '{"name": "b", "arguments": {"n": [1, 2]}}]',
        None,
        [("a", '{"k": "v"}'), ("b", '{"n": [1, 2]}')],
    ),
    (
        MistralToolParser(),
        'Thinking [TOOL_CALLS][{"name": "a", "arguments": {}}]',
        "Thinking",
        [("a", "{}")],
    ),
    (
        RequiredToolParser(),
        '[{"name": "a", "arguments": {"k": 1}}, {"name": "b", "arguments": {}}]',
        None,
        [("a", '{"k": 1}'), ("b", "{}")],
    ),
    (NamedToolParser("get_weather"), f"  {W}", None, [("get_weather", W)]),
    # Not calls (they stay content): a function the request did not declare, arguments given as
    # a string that is not JSON; in a region of several calls the ones before it are kept.
    (
        _declared(HermesToolParser, "get_weather"),
        'x <tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
        'x <tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
        [],
    ),
    (
        HermesToolParser(),
        '<tool_call>{"name": "f", "arguments": "not-json-string"}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "not-json-string"}</tool_call>',
        [],
    ),
    (
        _declared(MistralToolParser, "a"),
        '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "zz", "arguments": {}}]',
        ', {"name": "zz", "arguments": {}}]',
        [("a", "{}")],
    ),
    # Where a region stops parsing, the text from there is output again: content, then any
    # later call (it was dropped).
    (
        _declared(HermesToolParser, "a", "b"),
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}} oops\n</tool_call>\nMore text.\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
        " oops\n</tool_call>\nMore text.",
        [("a", '{"x": 1}'), ("b", "{}")],
    ),
    (
        _declared(HermesToolParser, "a"),
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call> then '
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call> then',
        [("a", "{}")],
    ),
    (
        HermesToolParser(),
        '<tool_call>{"name": "f", "arguments": 5}</tool_call>',
        '<tool_call>{"name": "f", "arguments": 5}</tool_call>',
        [],
    ),  # arguments that are no JSON object
    (
        HermesToolParser(),
        '<tool_call>{"name": "f", "arguments": "[1, 2]"}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "[1, 2]"}</tool_call>',
        [],
    ),
    (
        _declared(HermesToolParser, "get_weather"),
        f'<tool_call>{{"name": "get_weather", "arguments": {W}}}</tool_call>',
        None,
        [("get_weather", W)],
    ),
]


def _assemble(parser, text: str, cuts: list[int], parallel: bool = True):
    """Feed ``text`` in pieces ending at ``cuts``; returns (content, calls) from the deltas."""
    s = ToolCallStream(parser, parallel)
    content, calls = "", {}
    for k, cut in enumerate(cuts):
        piece, deltas = s.delta(text[:cut], final=k == len(cuts) - 1)
        content += piece
        for d in deltas:
            if d["index"] not in calls:
                assert d["id"].startswith("call_") and d["type"] == "function"
                calls[d["index"]] = [d["function"]["name"], d["function"]["arguments"]]
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]][1] += d["function"]["arguments"]
    return content or None, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("parser,text,content,calls", CASES, ids=range(len(CASES)))
def test_non_streamed_answer(parser, text, content, calls):
    got_content, got_calls = ToolCallStream(parser).message(text)
    assert got_content == (content if calls or content else "")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls
    for c in got_calls:
        json.loads(c["function"]["arguments"])  # always parses here (complete outputs)


@pytest.mark.parametrize("parser,text,content,calls", CASES, ids=range(len(CASES)))
def test_streamed_in_random_chunkings_equals_non_streamed(parser, text, content, calls):
    rng = random.Random(len(text))
    chunkings = [list(range(1, len(text) + 1))]  # one character at a time
    for _ in range(40):
        k = rng.randint(0, min(12, len(text) - 1))
        chunkings.append(sorted(rng.sample(range(1, len(text)), k)) + [len(text)])
    for cuts in chunkings:
        assert _assemble(parser, text, cuts) == (content, calls), cuts


def test_partial_marker_is_held_until_resolved():
    s = ToolCallStream(HermesToolParser())
    assert s.delta("Hi <tool_c", final=False) == ("Hi", [])
    assert s.delta("Hi <tool_cat>", final=False) == (" <tool_cat>", [])
    s = ToolCallStream(HermesToolParser())
    assert s.delta("<tool_call>{", final=False) == ("", [])
    content, deltas = s.delta('<tool_call>{"name": "f", "arguments": {"a"', final=False)
    assert content == "" and deltas[0]["function"] == {"name": "f", "arguments": '{"a"'}
    assert s.called is not False  # a call was sent


def test_parallel_false_keeps_the_first_call():
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"}</tool_call>'
    )
    _, calls = ToolCallStream(HermesToolParser(), parallel=False).message(text)
    assert [c["function"]["name"] for c in calls] == ["a"]
    assert _assemble(HermesToolParser(), text, [20, 60, len(text)], parallel=False) == (
        None,
        [("a", "{}")],
    )


# Outputs an "auto" call is cut in (max_tokens, EOS, a stop string): the cut call is no call
# (its arguments would not parse) but content, after the complete calls before it.
AUTO_CUT_CASES = [
    (HermesToolParser(), '<tool_call>{"name": "f", "arguments": {"city": "Par', None, []),
    (_declared(HermesToolParser, "f"), 'Hi <tool_call>{"name": "f", "argu', None, []),
    (Llama3ToolParser(), '{"name": "f", "parameters": {"x": [1, 2', None, []),
    (
        MistralToolParser(),
        '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1',
        ', {"name": "b", "arguments": {"x": 1',
        [("a", "{}")],
    ),
    (
        HermesToolParser(),
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "a',
        '\n<tool_call>{"name": "b", "a',
        [("a", "{}")],
    ),
]


@pytest.mark.parametrize("parser,text,content,calls", AUTO_CUT_CASES, ids=range(5))
def test_auto_call_cut_at_the_end_is_content_not_a_call(parser, text, content, calls):
    """Was a tool call with the arguments so far ('{"city": "Par'), which no client can run."""
    s = ToolCallStream(parser)
    got_content, got_calls = s.message(text)
    assert got_content == (text if content is None else content)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls
    assert not s.calls_complete  # the finish reason is never "tool_calls"
    for c in got_calls:
        json.loads(c["function"]["arguments"])
    # Streamed with nothing of the cut call sent before the end: the same answer.
    assert _assemble(parser, text, [len(text)]) == (got_content or None, calls)


def test_auto_call_cut_after_it_was_streamed_stays_a_call():
    """A stream cannot take back the fragments it sent: the cut call stays, unfinished, and
    its finish reason is not "tool_calls" (the caller keeps "length" / "stop")."""
    text = '<tool_call>{"name": "f", "arguments": {"city": "Par'
    s = ToolCallStream(HermesToolParser())
    _, sent = s.delta(text[:-3], final=False)
    assert sent[0]["function"] == {"name": "f", "arguments": '{"city": "'}
    content, more = s.delta(text, final=True)
    assert content == "" and more == [{"index": 0, "function": {"arguments": "Par"}}]
    assert s.called and not s.calls_ended


# Forced outputs cut short (max_tokens) before a call's arguments start: the name, with empty
# arguments; cut before any name is complete, the array is returned as content.
CUT_CASES = [
    (RequiredToolParser(), '[\n{\n "name": "get_weather",\n "arguments', None, [("get_weather", "")]),
    (RequiredToolParser(), '[{"name": "a", "arguments": {}}, {"name": "b"', None, [("a", "{}"), ("b", "")]),
    (RequiredToolParser(), '[\n{\n "na', '[\n{\n "na', []),
]


@pytest.mark.parametrize("parser,text,content,calls", CUT_CASES, ids=range(len(CUT_CASES)))
def test_cut_output_keeps_the_name_or_the_text(parser, text, content, calls):
    got_content, got_calls = ToolCallStream(parser).message(text)
    assert got_content == (content if calls or content else "")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls
    # Streamed in pieces: the same answer.
    for cuts in ([len(text)], list(range(1, len(text) + 1)), [3, len(text) - 1, len(text)]):
        assert _assemble(parser, text, cuts) == (content, calls), cuts


def test_value_end_and_scan_call():
    assert value_end('{"a": "}", "b": [1, {"c": 2}]} tail', 0) == 30
    assert value_end('{"a": [1, 2', 0) is None
    assert value_end("12", 0) is None and value_end("12,", 0) == 2
    assert value_end('"a\\"b" x', 0) == 6
    # Containers are checked for strings and bracket balance (not every JSON rule inside).
    assert value_end("{'a': 1}", 0) == 8
    for bad in ('{"a": ]', "tru,", "[1}", "}"):
        with pytest.raises(Malformed):
            value_end(bad, 0)
    scan = scan_call('{"arguments": {"x": 1}, "name": "f"}', 0, ("arguments",))
    assert (scan.name, scan.args_start, scan.args_end, scan.end) == ("f", 14, 22, 36)
    with pytest.raises(Malformed):
        scan_call('{"name": 3}', 0, ("arguments",))


def test_parser_for_template():
    assert parser_for_template(None) == "hermes"
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("Environment: ipython <|python_tag|>") == "llama3"
    assert parser_for_template("<tool_call> {{ tools }}") == "hermes"


F = {
    "name": "f",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    },
}
G = {"name": "g"}


def _req(**kw):
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


def test_required_schema_accepts_calls_and_rejects_others():
    cfg = resolve_tools(
        _req(
            tools=[{"type": "function", "function": F}, {"type": "function", "function": G}],
            tool_choice="required",
        )
    )
    schema = forced_schema(cfg)
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"z": [1]}}]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "f", "arguments": {"a": "x"}}],
        [{"name": "h", "arguments": {}}],
        [{"arguments": {"a": 1}, "name": "f", "extra": 1}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = forced_schema(
        resolve_tools(
            _req(
                tools=[{"type": "function", "function": F}],
                tool_choice="required",
                parallel_tool_calls=False,
            )
        )
    )
    assert single["maxItems"] == 1


def test_named_choice_and_legacy_functions():
    named = resolve_tools(_req(functions=[F, G], function_call={"name": "f"}))
    assert (named.choice, named.forced, forced_schema(named)) == ("f", True, F["parameters"])
    assert [t["function"]["name"] for t in named.tools] == ["f", "g"]
    auto = resolve_tools(_req(functions=[G]))
    assert (auto.choice, auto.active, auto.forced) == ("auto", True, False)
    assert auto.tools[0]["function"]["parameters"] == {"type": "object", "properties": {}}
    none = resolve_tools(_req(tools=[{"type": "function", "function": G}], tool_choice="none"))
    assert not none.active
    with pytest.raises(APIError) as e:
        resolve_tools(
            _req(
                tools=[{"type": "function", "function": G}],
                tool_choice={"type": "function", "function": {"name": "f"}},
            )
        )
    assert e.value.param == "tool_choice" and "'f'" in e.value.message
