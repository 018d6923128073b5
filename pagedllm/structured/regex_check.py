"""Regex anchors the grammar would misread: refused, never silently dropped.

The whole reply must match a ``structured_outputs.regex``, and xgrammar (0.2.x) reads a JSON-schema
``pattern`` as a whole-string match too, so ``^`` only means something where nothing can come
before it and ``$`` where nothing can come after it (anywhere else, as in ``a^b``, it matches
nothing). xgrammar drops every ``^`` and ``$`` wherever it sits (``a^b`` matched "ab", which
``re.fullmatch`` does not), and reads ``\\A``, ``\\Z`` and ``\\z`` as the letters A, Z and z
(ECMAScript's identity escapes; Python and PCRE read them as anchors), so a reply could break the
pattern its request gave. :func:`check_anchors` refuses such patterns instead.

The pattern is parsed with Python's own regex parser (``re._parser``; ``sre_parse`` before
Python 3.11). A pattern Python cannot parse (ECMAScript-only syntax) is left to xgrammar, after a
plain scan for the three letter escapes.
"""

from __future__ import annotations

import re
from typing import Any

try:
    from re import _parser as _sre  # type: ignore[attr-defined]  # Python >= 3.11
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _sre  # type: ignore[no-redef]

#: A backslash escape of A, Z or z outside a character class (an even run of backslashes
#: before it is escaped backslashes).
_LETTER_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\([AZz])")
_CLASS = re.compile(r"\[\^?\]?(?:\\.|[^\]\\])*\]")
_REPEATS = (_sre.MAX_REPEAT, _sre.MIN_REPEAT, getattr(_sre, "POSSESSIVE_REPEAT", _sre.MAX_REPEAT))


def check_anchors(pattern: str) -> None:
    """Refuse a regex whose anchors the grammar would misread (module docstring).

    Args:
        pattern: the regex the whole generated text (or JSON string) must match.

    Raises:
        ValueError: "'^' is supported only at the start of the pattern ...", "'$' ... only at
            the end ...", or "'\\\\A' is not supported ..." (also ``\\Z``, ``\\z``).
    """
    try:
        tree = _sre.parse(pattern)
    except re.error:
        letters = _LETTER_ESCAPE.search(_CLASS.sub("", pattern))
        if letters:
            _refuse_letter(letters.group(1))
        return  # xgrammar's dialect (ECMAScript) may still read it
    if tree.state.flags & re.MULTILINE:
        return  # anchors then match at line ends too; xgrammar refuses the (?m) flag itself
    _walk(list(tree), at_start=True, at_end=True)


def _refuse_letter(letter: str) -> None:
    raise ValueError(
        f"'\\{letter}' is not supported: the grammar reads it as the letter '{letter}' "
        "(ECMAScript), not as an anchor; leave it out (the whole reply must match the pattern "
        "anyway)"
    )


def _zero_width(item: tuple[Any, Any]) -> bool:
    return item[0] is _sre.AT


def _walk(items: list[tuple[Any, Any]], at_start: bool, at_end: bool) -> None:
    """Check the anchors of one sequence of parsed items; ``at_start`` / ``at_end``: nothing
    can be matched before / after this sequence."""
    for i, (op, av) in enumerate(items):
        first = at_start and all(_zero_width(x) for x in items[:i])
        last = at_end and all(_zero_width(x) for x in items[i + 1 :])
        if op is _sre.AT:
            if av is _sre.AT_BEGINNING_STRING:
                _refuse_letter("A")
            if av is _sre.AT_END_STRING:
                _refuse_letter("Z")
            if av is _sre.AT_BEGINNING and not first:
                raise ValueError(
                    "'^' is supported only at the start of the pattern: the whole reply must "
                    "match it, so elsewhere it matches nothing"
                )
            if av is _sre.AT_END and not last:
                raise ValueError(
                    "'$' is supported only at the end of the pattern: the whole reply must "
                    "match it, so elsewhere it matches nothing"
                )
        elif op is _sre.BRANCH:
            for branch in av[1]:
                _walk(list(branch), first, last)
        elif op is _sre.SUBPATTERN:
            _walk(list(av[-1]), first, last)
        elif op in _REPEATS:
            once = av[1] <= 1  # a repeated anchor would sit after / before the other rounds
            _walk(list(av[2]), first and once, last and once)
        elif op is getattr(_sre, "ATOMIC_GROUP", None):
            _walk(list(av), first, last)


def pattern_lengths(pattern: str) -> tuple[int, int | None] | None:
    """The shortest and longest string ``pattern`` matches whole (None: no longest), or None
    when Python cannot parse it (an ECMAScript-only pattern)."""
    try:
        lo, hi = _sre.parse(pattern).getwidth()
    except re.error:
        return None
    return int(lo), (int(hi) if hi < _sre.MAXREPEAT else None)
