"""Regex anchors the grammar would misread are refused (``structured/regex_check.py``): the
accepted patterns are exactly those whose anchors sit where ``re.fullmatch`` can use them."""

import re

import pytest

from pagedllm.structured.regex_check import check_anchors


@pytest.mark.parametrize(
    "pattern",
    ["^ab$", "^a|^b", "(^a)b", "a(b$)", "(a|^b)c", "^(?:a|b)+$", "(^a)?b", r"[\^$]x", r"\\Z",
     r"a\\z", "[a-z]+", "(?<n>a)b", "(?m)^a$\n^b$"],  # (?m): left to the grammar
)
def test_anchors_at_the_ends_and_escaped_characters_pass(pattern: str) -> None:
    check_anchors(pattern)


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("a^b", "'^' is supported only at the start"),
        ("a*^b", "'^' is supported only at the start"),
        ("(^a)*b", "'^' is supported only at the start"),  # the second round follows the first
        ("a$b", "'$' is supported only at the end"),
        ("(ab$|c)d", "'$' is supported only at the end"),
        (r"\Aab", "'\\A' is not supported: the grammar reads it as the letter 'A'"),
        (r"a\Zb", "'\\Z' is not supported"),
        (r"a\z", "'\\z' is not supported"),  # Python cannot parse it: the plain scan finds it
        (r"(?<n>a)\z", "'\\z' is not supported"),
    ],
)
def test_misplaced_anchors_and_letter_escapes_are_refused(pattern: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        check_anchors(pattern)
    # Dropping a refused '^' / '$' (what the grammar did) lets through a string the pattern
    # does not match.
    if message[1] in "^$":
        dropped = re.sub(r"[\^$]", "", pattern)
        assert any(
            re.fullmatch(dropped, s) and not re.fullmatch(pattern, s)
            for s in ("ab", "aab", "abd", "cd", "b")
        )
