"""Scanning JSON text that may still be arriving: where a value ends, or that it has not ended
yet, without parsing it. The tool-call parsers use it to cut a model's output into calls while
it streams.

Every function takes the text seen so far and a start index, and answers ``None`` when the text
ends before the value does (more may come), or raises ``Malformed`` when no continuation can make
it valid JSON as far as the scan checks: strings, bracket balance, the literals and numbers
outside containers, and the keys of a call object (not every rule inside an arguments object,
which the grammar guarantees when a call is forced). They never look past the end of the value, so a scan of a prefix agrees with the
scan of the whole text (the streaming parsers rely on that). JSON grammar: RFC 8259.
"""

from __future__ import annotations

import json
import re
from contextvars import ContextVar
from dataclasses import dataclass

WHITESPACE = " \t\r\n"
_LITERAL_CHARS = set("0123456789+-.eEtruefalsn")


class Malformed(ValueError):
    """The text cannot be the start of a valid JSON value (at ``index``)."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(f"{message} at character {index}")
        self.index = index


def skip_ws(text: str, i: int) -> int:
    """The index of the first non-whitespace character at or after ``i`` (``len(text)`` if none)."""
    n = len(text)
    while i < n and text[i] in WHITESPACE:
        i += 1
    return i


#: A complete JSON string (escapes skipped), a bracket, or a lone quote (an unfinished string).
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_CONTAINER_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]|"', re.S)


#: Container scans of a text that only grows, kept by a streaming caller (``ToolCallStream``):
#: start index -> (index to resume at, brackets still open). Unset: every scan starts afresh.
container_memo: ContextVar[dict[int, tuple[int, list[str]]] | None] = ContextVar(
    "container_memo", default=None
)


def string_end(text: str, i: int) -> int | None:
    """The index just past the JSON string starting at ``text[i] == '"'``, or None if unfinished."""
    m = _STRING.match(text, i)
    return m.end() if m else None


def _container_end(text: str, i: int) -> int | None:
    """``value_end`` of the object or array at ``text[i]``, resuming from ``container_memo``."""
    memo = container_memo.get()
    pos, stack = memo[i] if memo is not None and i in memo else (i + 1, [text[i]])
    stack = list(stack)
    if not stack:
        return pos
    end: int | None = None
    for m in _CONTAINER_TOKEN.finditer(text, pos):
        tok = m.group()
        if tok == '"':
            break  # a string still open at the end of the text
        pos = m.end()
        if tok[0] == '"':
            continue
        if tok in "{[":
            stack.append(tok)
            continue
        if (stack[-1] == "{") != (tok == "}"):
            raise Malformed(f"unbalanced {tok!r}", m.start())
        stack.pop()
        if not stack:
            end = pos
            break
    if memo is not None:
        memo[i] = (pos, stack)
    return end


def value_end(text: str, i: int) -> int | None:
    """The index just past the JSON value starting at ``text[i]`` (no leading whitespace), or
    None when the text ends first. A number or literal at the very end of ``text`` counts as
    unfinished (another digit may follow). Containers are scanned for strings and brackets
    only, with one regular expression; a streaming caller resumes them (``container_memo``).

    Raises:
        Malformed: a character no JSON value can start with, or unbalanced brackets.
    """
    n = len(text)
    if i >= n:
        return None
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        return _container_end(text, i)
    if c not in _LITERAL_CHARS:
        raise Malformed(f"unexpected {c!r}", i)
    j = i
    while j < n and text[j] in _LITERAL_CHARS:
        j += 1
    if j == n:
        return None
    try:
        json.loads(text[i:j])
    except ValueError:
        raise Malformed("invalid number or literal", i) from None
    return j


@dataclass
class CallScan:
    """What the text of one call object ``{"name": ..., "arguments": ...}`` shows so far.

    ``name`` is set once its string is complete; ``args_start`` / ``args_end`` index the
    arguments value in the scanned text (``args_end`` None while it is unfinished); ``end`` is
    the index just past the object's ``}`` (None while unfinished).
    """

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    end: int | None = None


def scan_call(text: str, i: int, args_keys: tuple[str, ...]) -> CallScan:
    """Scan the call object starting at ``text[i] == '{'``: its ``name`` and the span of the value
    of the first key of ``args_keys`` present (``arguments``, or Llama 3's ``parameters``).

    Raises:
        Malformed: not an object, a non-string ``name``, or invalid JSON so far.
    """
    scan = CallScan()
    if text[i] != "{":
        raise Malformed("a tool call must be a JSON object", i)
    j = skip_ws(text, i + 1)
    if j < len(text) and text[j] == "}":
        scan.end = j + 1
        return scan
    while True:
        if j >= len(text):
            return scan
        if text[j] != '"':
            raise Malformed("expected a key", j)
        kend = string_end(text, j)
        if kend is None:
            return scan
        key = json.loads(text[j:kend])
        j = skip_ws(text, kend)
        if j >= len(text):
            return scan
        if text[j] != ":":
            raise Malformed("expected ':'", j)
        v = skip_ws(text, j + 1)
        if v >= len(text):
            return scan
        vend = value_end(text, v)
        if key == "name" and scan.name is None:
            if text[v] != '"':
                raise Malformed("the tool name must be a string", v)
            if vend is not None:
                scan.name = json.loads(text[v:vend])
        elif key in args_keys and scan.args_start is None:
            scan.args_start, scan.args_end = v, vend
        if vend is None:
            return scan
        j = skip_ws(text, vend)
        if j >= len(text):
            return scan
        if text[j] == "}":
            scan.end = j + 1
            return scan
        if text[j] != ",":
            raise Malformed("expected ',' or '}'", j)
        j = skip_ws(text, j + 1)
