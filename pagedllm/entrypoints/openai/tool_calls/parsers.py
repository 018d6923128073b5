"""Tool-call parsers: cut a model's output into content and OpenAI-shaped tool calls, for the
Hermes / Qwen 2.5 (``<tool_call>{...}</tool_call>``), Llama 3 (``{"name", "parameters"}`` or
``<|python_tag|>`` calls separated by ``;``) and Mistral (``[TOOL_CALLS][{...}, ...]``) formats,
and for the JSON the grammar forces under ``tool_choice`` ``required`` (an array of calls) or a
named function (the arguments object alone).

A parser is one pure function of the text generated so far, ``parse(text, final)``, whose answer
only grows as text is appended (content is a prefix of the later content, each call's arguments a
prefix of its later arguments): text that may still turn out to be a tool call (a partial
``<tool_c``) or trailing whitespace is held back until ``final``. Streaming (``ToolCallStream``)
sends the difference between two answers, and the non-streamed answer is ``parse(text, True)``,
so the streamed deltas concatenate to exactly the non-streamed call whatever the chunking.
Arguments are the model's own JSON text of the value (not re-serialized), which is what makes
that possible while the value is still arriving.

One exception: a call the end of the output cuts (``max_tokens``, EOS or a stop string inside
it). The non-streamed answer returns its text as content, never as a call whose arguments do not
parse (``cut_calls=False``); a stream does the same unless it already sent part of that call,
which it cannot take back (see ``ToolCallStream.delta``).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.tool_calls.json_scan import (
    CallScan,
    Malformed,
    container_memo,
    scan_call,
    skip_ws,
    value_end,
)

#: Keys a call object may hold its arguments under (Llama 3 writes ``parameters``).
ARGS_KEYS = ("arguments", "parameters")


@dataclass
class ParsedCall:
    """One tool call as far as it is known: ``name`` (None until complete, until its arguments
    start unless the output ended before them, and while arguments sent as a JSON-encoded
    string are unfinished: only the whole string tells whether they are JSON), ``arguments``
    (JSON text, possibly unfinished), ``complete`` once the call's text has ended; ``valid``
    False for arguments that are not a JSON object (nor a string holding one); ``end`` the
    index past the call's text once complete."""

    name: str | None
    arguments: str
    complete: bool
    valid: bool = True
    end: int | None = None


@dataclass
class ParseResult:
    """``content``: the text outside tool calls; ``calls``: the calls found, in order; ``cut``:
    a call the end of the text cut was returned as content (``parse(..., cut_calls=False)``)."""

    content: str
    calls: list[ParsedCall] = field(default_factory=list)
    cut: bool = False


class _Unfinished(Exception):
    """The text ends inside a tool-call region (more output may complete it)."""


def _call_from_scan(text: str, scan: CallScan, final: bool) -> ParsedCall:
    complete = scan.end is not None
    if scan.args_start is None:
        if not complete:
            # Held until the arguments start (they may come as a string), unless the output
            # ended here (``max_tokens``, a stop string): the name is then all there is.
            return ParsedCall(scan.name if final else None, "", False)
        args = "{}"
    elif text[scan.args_start] == '"':  # arguments sent as a JSON-encoded string
        if not scan.args_end:
            return ParsedCall(None, "", complete)  # held until the string ends
        args = json.loads(text[scan.args_start : scan.args_end])
        try:
            valid = isinstance(json.loads(args), dict)
        except ValueError:
            valid = False
        return ParsedCall(scan.name, args, complete, valid, scan.end)
    else:
        args = text[scan.args_start : scan.args_end if scan.args_end is not None else len(text)]
        if text[scan.args_start] != "{":  # a number, null, an array: no arguments object
            return ParsedCall(scan.name, args, complete, False, scan.end)
    return ParsedCall(scan.name, args, complete, end=scan.end)


def _one_call(text: str, j: int, calls: list[ParsedCall], final: bool) -> int:
    """Scan the call object at ``text[j]`` into ``calls`` (``final``: no more text will come);
    returns the index past it.

    Raises: _Unfinished, Malformed."""
    if j >= len(text):
        raise _Unfinished()
    scan = scan_call(text, j, ARGS_KEYS)
    calls.append(_call_from_scan(text, scan, final))
    if scan.end is None:
        raise _Unfinished()
    return scan.end


def _call_array(text: str, j: int, calls: list[ParsedCall], final: bool) -> int:
    """``[{call}, {call}, ...]`` starting at ``text[j]`` (Mistral, ``required``)."""
    if j >= len(text):
        raise _Unfinished()
    if text[j] != "[":
        raise Malformed("expected '['", j)
    j = skip_ws(text, j + 1)
    if j < len(text) and text[j] == "]":
        return j + 1
    while True:
        j = skip_ws(text, _one_call(text, j, calls, final))
        if j >= len(text):
            raise _Unfinished()
        if text[j] == "]":
            return j + 1
        if text[j] != ",":
            raise Malformed("expected ',' or ']'", j)
        j = skip_ws(text, j + 1)


class ToolParser:
    """Base of the output formats: ``markers`` open a tool-call region, ``region`` scans one."""

    #: Strings that open a tool-call region.
    markers: tuple[str, ...] = ()
    #: Whether output starting with ``{`` (after whitespace) is a tool-call region (Llama 3).
    bare_json = False
    #: The request's function names (``tool_choice="auto"``): a call naming another function
    #: is no call (None: any name).
    declared: frozenset[str] | None = None

    def region(self, text: str, j: int, calls: list[ParsedCall], final: bool) -> int:
        """Scan the region whose body starts at ``text[j]`` into ``calls``; returns the index
        past it.

        Raises:
            _Unfinished: the text ends inside the region. Malformed: it is not a valid region.
        """
        raise NotImplementedError

    def _find_marker(self, text: str, i: int) -> tuple[int, str] | None:
        found = [(p, m) for m in self.markers if (p := text.find(m, i)) >= 0]
        return min(found) if found else None

    def _held_suffix(self, text: str) -> int:
        """Length of the longest end of ``text`` that is a proper start of a marker."""
        best = 0
        for m in self.markers:
            for k in range(min(len(m) - 1, len(text)), best, -1):
                if text.endswith(m[:k]):
                    best = k
                    break
        return best

    def _scan_region(
        self,
        text: str,
        start: int,
        body: int,
        final: bool,
        parts: list[str],
        res: ParseResult,
        cut_calls: bool,
    ) -> int | None:
        """Scan one region (marker at ``start``, body at ``body``) into ``res.calls`` and
        ``parts`` (content); the index to go on from, or None to stop. A region without a named
        call is content after all. Where a region stops parsing (malformed text, a call that may
        not be sent, or, unless ``cut_calls``, a call the end of the text cuts), the calls before
        that point are kept and the text from there on is read again as ordinary output
        (content, and any later regions): model output never vanishes."""
        calls = res.calls
        found: list[ParsedCall] = []
        try:
            end: int | None = self.region(text, body, found, final)
            unfinished = malformed = False
        except _Unfinished:
            end, unfinished, malformed = None, True, False
        except Malformed:
            end, unfinished, malformed = None, False, True
        # A call to an undeclared function, or whose arguments are no JSON object, is no call:
        # the region stops parsing before it. Known once its name and the start (a string: the
        # whole) of its arguments are, before any of the call is sent, so what was streamed
        # stands.
        bad = next((k for k, c in enumerate(found) if not self._is_call(c)), None)
        if bad is not None:
            found, end, unfinished, malformed = found[:bad], None, False, True
        if unfinished and not final:
            calls.extend(found)
            return None
        if unfinished and not cut_calls and any(c.name is not None for c in found):
            # A call cut by the end of the output (max_tokens, EOS, a stop string): its
            # arguments do not parse, so it is no call; read as text like a malformed one.
            res.cut = malformed = True
        if malformed:
            kept = [c for c in found if c.complete and c.end is not None]
            if kept:
                calls.extend(kept)
                return kept[-1].end  # read on after the last call kept
            parts.append(text[start:body])  # the marker was text after all
            return body
        if any(c.name is not None for c in found):
            calls.extend(found)
            return end
        parts.append(text[start : end if end is not None else len(text)])
        return end

    def _is_call(self, c: ParsedCall) -> bool:
        """False for a named call that may not be sent (``declared``, ``ParsedCall.valid``)."""
        if c.name is None:
            return True  # not known yet
        return c.valid and (self.declared is None or c.name in self.declared)

    def parse(self, text: str, final: bool, cut_calls: bool = True) -> ParseResult:
        """Content and calls of ``text``; ``final`` when no more text will come.

        Args:
            text: the generated text so far (a later call passes this text extended).
            cut_calls: with ``final``, whether a call the end of the text cuts is returned as
                far as it goes (unfinished arguments); False returns its text as content
                instead (``ParseResult.cut``).
        """
        parts: list[str] = []
        res = ParseResult("")
        calls = res.calls
        cut_calls = cut_calls or not final
        i: int | None = 0
        if self.bare_json:
            j = skip_ws(text, 0)
            if j == len(text) and not final:
                return res
            if j < len(text) and text[j] == "{":
                i = self._scan_region(text, 0, j, final, parts, res, cut_calls)
        while i is not None:
            hit = self._find_marker(text, i)
            if hit is None:
                tail = text[i:]
                if not final:
                    tail = tail[: len(tail) - self._held_suffix(tail)]
                parts.append(tail)
                break
            pos, marker = hit
            parts.append(text[i:pos])
            i = self._scan_region(text, pos, pos + len(marker), final, parts, res, cut_calls)
        content = "".join(parts)
        if calls or not final:  # whitespace around calls is no content
            content = content.rstrip()
        res.content = content
        return res


class HermesToolParser(ToolParser):
    """Hermes / Qwen 2.5: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

    markers = ("<tool_call>",)
    end_marker = "</tool_call>"

    def region(self, text: str, j: int, calls: list[ParsedCall], final: bool) -> int:
        k = skip_ws(text, _one_call(text, skip_ws(text, j), calls, final))
        rest = text[k : k + len(self.end_marker)]
        if rest == self.end_marker:
            return k + len(self.end_marker)
        if self.end_marker.startswith(rest):
            if final:
                return len(text)  # a missing closing tag at the end is forgiven
            raise _Unfinished()
        raise Malformed("expected </tool_call>", k)


class Llama3ToolParser(ToolParser):
    """Llama 3.x JSON tool calls: ``{"name": ..., "parameters": {...}}`` as the whole output, or
    after ``<|python_tag|>``; several separated by ``;``."""

    markers = ("<|python_tag|>",)
    bare_json = True

    def region(self, text: str, j: int, calls: list[ParsedCall], final: bool) -> int:
        while True:
            end = _one_call(text, skip_ws(text, j), calls, final)
            k = skip_ws(text, end)
            if k >= len(text) and not final:
                raise _Unfinished()
            if k < len(text) and text[k] == ";":
                j = k + 1
                continue
            return end


class MistralToolParser(ToolParser):
    """Mistral (v0.3 tokenizers): ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``."""

    markers = ("[TOOL_CALLS]",)

    def region(self, text: str, j: int, calls: list[ParsedCall], final: bool) -> int:
        return _call_array(text, skip_ws(text, j), calls, final)


class RequiredToolParser(ToolParser):
    """The output forced by ``tool_choice="required"``: a JSON array of ``{"name",
    "arguments"}`` objects (see ``schema.required_schema``)."""

    def parse(self, text: str, final: bool, cut_calls: bool = True) -> ParseResult:
        """The forced array as far as it goes: the grammar makes the output a call whatever cut
        it (``cut_calls`` is not used); only a cut before any name is content."""
        calls: list[ParsedCall] = []
        with contextlib.suppress(_Unfinished, Malformed):
            _call_array(text, skip_ws(text, 0), calls, final)
        if final and not any(c.name is not None for c in calls):
            # Cut before a name was complete (``max_tokens``): the text is all there is.
            return ParseResult(text.strip())
        return ParseResult("", calls)


class NamedToolParser(ToolParser):
    """The output forced by a named ``tool_choice``: the function's arguments object alone."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, final: bool, cut_calls: bool = True) -> ParseResult:
        """The forced arguments as far as they go (the grammar makes the output this call
        whatever cut it: ``cut_calls`` is not used)."""
        v = skip_ws(text, 0)
        try:
            end = value_end(text, v)
        except Malformed:
            end = None
        args = text[v : end if end is not None else len(text)]
        return ParseResult("", [ParsedCall(self.name, args, end is not None)])


#: ``--tool-call-parser`` names.
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "llama3": Llama3ToolParser,
    "mistral": MistralToolParser,
}


def parser_for_template(template: str | None) -> str:
    """The parser name matching a chat template's tool-call format (``hermes`` by default, the
    format of the shipped tool template)."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3"
    return "hermes"


def new_call_id() -> str:
    """A fresh tool call id (``call_`` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def named_calls(calls: list[ParsedCall], parallel: bool) -> list[ParsedCall]:
    """The calls up to the first one without a name yet (only the first when not ``parallel``)."""
    out: list[ParsedCall] = []
    for c in calls:
        if c.name is None or (out and not parallel):
            break
        out.append(c)
    return out


class ToolCallStream:
    """One choice's tool-call parsing, streamed or not.

    Args:
        parser: the output format.
        parallel: ``parallel_tool_calls`` (false keeps only the first call).
    """

    def __init__(self, parser: ToolParser, parallel: bool = True) -> None:
        self.parser = parser
        self.parallel = parallel
        self.content_sent = 0
        self.ids: list[str] = []
        self.args_sent: list[int] = []
        self._scans: dict[int, tuple[int, list[str]]] = {}
        #: Whether every call parsed so far has ended (max_tokens or a stop string may cut one,
        #: which then stays a call when streamed, or becomes content).
        self.calls_complete = True

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The non-streamed ``content`` (None when empty and there are calls) and ``tool_calls``
        of the finished ``text``; a call the end of ``text`` cut is content, not a call (its
        arguments would not parse)."""
        res = self.parser.parse(text, final=True, cut_calls=False)
        named = named_calls(res.calls, self.parallel)
        self.calls_complete = all(c.complete for c in named) and not res.cut
        calls = [
            {
                "id": new_call_id(),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in named
        ]
        return (res.content or (None if calls else "")), calls

    def delta(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """What ``text`` (everything generated so far) adds to what was sent: a content piece and
        ``tool_calls`` delta entries (id, type and name once, then argument fragments).

        A call the end of the output cuts goes out as content, as in ``message``, unless part
        of it was sent already: a stream cannot take back what it sent, so that call stays
        (with unfinished arguments) and only the finish reason (``length`` / ``stop``, never
        ``tool_calls``: ``calls_ended``) tells it was cut, as OpenAI's streams do."""
        token = container_memo.set(self._scans)  # text only grows: resume container scans
        try:
            res = self.parser.parse(text, final)
            cut = final and bool(res.calls) and not res.calls[-1].complete
            if cut and len(res.calls) > len(self.ids):  # the cut call was not sent: content
                res = self.parser.parse(text, final, cut_calls=False)
        finally:
            container_memo.reset(token)
        content = res.content[self.content_sent :]
        self.content_sent = max(self.content_sent, len(res.content))
        out: list[dict[str, Any]] = []
        named = named_calls(res.calls, self.parallel)
        self.calls_complete = all(c.complete for c in named) and not res.cut
        for idx, c in enumerate(named):
            if idx == len(self.ids):
                self.ids.append(new_call_id())
                self.args_sent.append(0)
                fn = {"name": c.name, "arguments": c.arguments}
                out.append({"index": idx, "id": self.ids[idx], "type": "function", "function": fn})
            elif len(c.arguments) > self.args_sent[idx]:
                piece = c.arguments[self.args_sent[idx] :]
                out.append({"index": idx, "function": {"arguments": piece}})
            self.args_sent[idx] = max(self.args_sent[idx], len(c.arguments))
        return content, out

    @property
    def called(self) -> bool:
        """Whether a tool call has been sent."""
        return bool(self.ids)

    @property
    def calls_ended(self) -> bool:
        """Whether a tool call has been sent and every call sent has ended (the finish reason
        becomes ``tool_calls``; a call cut by a stop string keeps ``stop``)."""
        return bool(self.ids) and self.calls_complete
