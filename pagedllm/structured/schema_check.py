"""JSON-schema keywords the grammar cannot enforce: refused, never silently dropped.

xgrammar (0.2.x) compiles a JSON schema into a grammar but skips the keywords whose constraint is
not context-free or that it does not implement yet: ``not``, ``if`` / ``then`` / ``else``,
``uniqueItems``, ``dependentRequired`` / ``dependentSchemas`` / ``dependencies``,
``unevaluatedProperties`` / ``unevaluatedItems``, ``contains`` / ``minContains`` /
``maxContains``, and ``allOf`` with more than one schema (it
logs "still ongoing" and keeps one). A reply generated under such a schema may then break it
while ``finish_reason`` says ``stop``. :func:`check_schema` finds them first, so the request is
a 400 naming the keyword and where it sits. An ``allOf`` whose schemas share no keyword (the
usual "a type here, a bound there") is merged into its parent instead, which means the same.

It also refuses what xgrammar accepts but cannot mean: an empty ``anyOf`` / ``oneOf`` or
``type: []`` (no value matches; the grammar allowed an empty or broken reply ending "stop"), a
``$ref`` outside the schema (nothing may be fetched; the constraint was dropped) and a
``pattern`` with a lookaround (``(?=``, ``(?!``, ``(?<=``, ``(?<!``; the grammar ignored it,
while the same regex as ``structured_outputs.regex`` is refused), a misplaced anchor in it
(``regex_check``), a ``pattern`` beside a ``format`` the grammar enforces (``FORMAT_LENGTHS``)
or either beside a ``minLength`` / ``maxLength`` their lengths do not imply (the grammar keeps
only one of them: the format, else the pattern; a ``maxLength`` of ``UNENFORCED_MAX_LENGTH`` or
more is accepted unenforced), and a ``multipleOf`` other than an integer step on integers (the
grammar drops it for other numbers: ``{"type": "number", "multipleOf": 3}`` gave ``2.0``). A
``const`` / ``enum`` value is emitted whatever the schema's other keywords say (``{"type":
"string", "const": 5}`` gave ``5``), so the values that break them are dropped, and a schema
left with none matches no value.

Objects are compiled in xgrammar's strict mode, where an absent ``additionalProperties`` means
no property beyond ``properties``. Two schemas that JSON Schema satisfies with such properties
are completed instead: a ``required`` name missing from ``properties`` is added to them (with
the ``additionalProperties`` schema, else any value; the grammar ignored it and the reply
lacked it). A ``minProperties`` above the number of ``properties`` is refused: only additional
or pattern keys could make up the count, and the grammar may repeat a key (``{"x": 0, "x":
1}`` parses to one property).

``oneOf`` stays: xgrammar enforces it exactly when its branches are provably disjoint (a
string or an integer; objects told apart by a ``const`` tag, as pydantic's discriminated
unions are) and as ``anyOf`` otherwise (README, "Structured outputs").
"""

from __future__ import annotations

from typing import Any

import jsonschema

from pagedllm.structured.regex_check import check_anchors, pattern_lengths

#: Keywords whose constraint the grammar would drop (an annotation such as ``contentEncoding``
#: or ``format`` constrains nothing that must be refused).
UNENFORCED_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "unevaluatedProperties",
    "unevaluatedItems",
    "contains",
    "minContains",
    "maxContains",
)

_LOOKAROUNDS = ("(?=", "(?!", "(?<=", "(?<!")

# Keywords holding one subschema, a list of them, or a name -> subschema map.
_ONE = ("additionalProperties", "items", "contains", "propertyNames", "additionalItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions")


class Unsatisfiable(ValueError):
    """A (sub)schema that matches no value: refused at the root, dropped as a branch of an
    ``anyOf`` / ``oneOf`` that has others (it could never be the branch a value matches)."""


def check_schema(schema: Any) -> Any:
    """``schema`` with each mergeable ``allOf`` merged into its parent and ``const`` / ``enum``
    values that break their schema dropped (a new dict; the input is not changed).

    Raises:
        ValueError: "'KEYWORD' at PATH is not supported ..." for a keyword of
            ``UNENFORCED_KEYWORDS``, ``uniqueItems: true``, an ``allOf`` of several schemas
            that share a keyword or use ``$ref``, a ``$ref`` not starting with "#", a
            lookaround or misplaced anchor in ``pattern``, ``pattern`` / ``format`` beside each
            other or beside ``minLength`` / ``maxLength``, a ``multipleOf`` that is not an
            integer step on integers; ``Unsatisfiable`` ("... matches no
            value") for a schema that matches no value (an empty ``anyOf`` / ``oneOf`` /
            ``type`` list, a required property that ``additionalProperties: false`` forbids, a
            ``const`` / ``enum`` none of whose values satisfies the other keywords), unless it
            is one of several branches of an ``anyOf`` / ``oneOf``: such a branch is dropped.
            PATH is a JSON pointer ("/" for the root).
    """
    return _check(schema, "")


def _check(node: Any, path: str) -> Any:
    if not isinstance(node, dict):
        return node  # true / false schemas, and values of non-schema keywords
    where = path or "/"
    out = _merge_all_of(node, where) if "allOf" in node else dict(node)
    for key in UNENFORCED_KEYWORDS:
        if key in out:
            raise ValueError(f"'{key}' at {where} is not supported (the grammar cannot enforce it)")
    if out.get("uniqueItems") is True:
        raise ValueError(
            f"'uniqueItems' at {where} is not supported (the grammar cannot enforce it)"
        )
    for key in ("anyOf", "oneOf", "type"):
        if out.get(key) == []:
            raise Unsatisfiable(
                f"'{key}' at {where} is an empty list: the schema matches no value"
            )
    ref = out.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise ValueError(
            f"'$ref' at {where} is not supported: only references inside the schema "
            f"(starting with '#') can be resolved, not {ref!r}"
        )
    _check_string(out, where)
    step = out.get("multipleOf")
    if isinstance(step, float) and step.is_integer():
        out["multipleOf"] = int(step)  # 5.0: the grammar steps by integers only
    if "const" in out or "enum" in out:
        _keep_valid_values(out, where)
    elif "multipleOf" in out and not _integer_multiple(out["multipleOf"], out.get("type")):
        raise ValueError(
            f"'multipleOf' at {where} is not supported except as an integer on 'type': "
            "'integer' (the grammar drops it for other numbers)"
        )
    _complete_object(out, where)
    for key in _ONE:
        if key in out:
            out[key] = _check(out[key], f"{path}/{key}")
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = _check_list(out[key], key, path, where)
    if isinstance(out.get("items"), list):  # draft-07 tuple form
        out["items"] = [_check(s, f"{path}/items/{i}") for i, s in enumerate(out["items"])]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {
                name: _check(s, f"{path}/{key}/{_escape(name)}") for name, s in out[key].items()
            }
    return out


def rebase_local_refs(schema: Any, base: str) -> Any:
    """``schema`` (a new object; the input is not changed) with every local ``$ref`` ("#...")
    in a schema position prefixed by the JSON pointer ``base``: what its references mean once
    the schema sits at ``base`` inside a larger one (a tool's parameters inside the schema of
    ``tool_choice="required"``, whose root is no longer theirs). ``const`` / ``enum`` /
    ``default`` values are data and stay as they are."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    ref = out.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = "#" + base + ref[1:]
    for key in _ONE:
        if key in out:
            out[key] = rebase_local_refs(out[key], base)
    for key in _LIST + ("items",):
        if isinstance(out.get(key), list):
            out[key] = [rebase_local_refs(x, base) for x in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: rebase_local_refs(x, base) for name, x in out[key].items()}
    return out


def _check_list(schemas: list[Any], key: str, path: str, where: str) -> list[Any]:
    """The checked schemas of list keyword ``key``; for ``anyOf`` / ``oneOf`` without the
    branches that match no value (``Unsatisfiable``).

    Raises:
        Unsatisfiable: every branch of an ``anyOf`` / ``oneOf`` matches no value.
    """
    if key not in ("anyOf", "oneOf"):
        return [_check(s, f"{path}/{key}/{i}") for i, s in enumerate(schemas)]
    kept, first_error = [], None
    for i, s in enumerate(schemas):
        try:
            kept.append(_check(s, f"{path}/{key}/{i}"))
        except Unsatisfiable as e:
            first_error = first_error or e
    if not kept and first_error is not None:
        raise Unsatisfiable(f"no branch of '{key}' at {where} matches a value: {first_error}")
    return kept


def _check_string(out: dict[str, Any], where: str) -> None:
    """Refuse the string keywords the grammar would misread or drop.

    Raises:
        ValueError: a lookaround or a misplaced anchor in ``pattern`` (``regex_check``);
            ``pattern`` beside a ``format`` of ``FORMAT_LENGTHS``, or either beside a
            ``minLength`` / ``maxLength`` its lengths do not imply (the grammar enforces only
            one of them: the format, else the pattern; ``UNENFORCED_MAX_LENGTH``).
    """
    pattern = out.get("pattern")
    if isinstance(pattern, str):
        if any(a in pattern for a in _LOOKAROUNDS):
            raise ValueError(
                f"'pattern' at {where} is not supported: the grammar cannot enforce a "
                "lookaround ((?=, (?!, (?<=, (?<!)"
            )
        try:
            check_anchors(pattern)
        except ValueError as e:
            raise ValueError(f"'pattern' at {where} is not supported: {e}") from None
    shape = ["format"] if out.get("format") in FORMAT_LENGTHS else []
    shape += ["pattern"] if isinstance(pattern, str) else []
    if not shape:
        return
    if len(shape) == 2:
        bound = "pattern"
    else:  # a bound the format / pattern already implies holds; another would be dropped
        lengths = (
            FORMAT_LENGTHS[out["format"]] if shape[0] == "format" else pattern_lengths(str(pattern))
        )
        lo, hi = lengths if lengths is not None else (0, None)  # unknown: nothing implied
        low, high = out.get("minLength", 0), out.get("maxLength")
        low_ok = not isinstance(low, int) or low <= lo  # not an int: xgrammar refuses it
        high_ok = (
            not isinstance(high, int)
            or high >= UNENFORCED_MAX_LENGTH
            or (hi is not None and high >= hi)
        )
        if low_ok and high_ok:
            return
        bound = "minLength" if not low_ok else "maxLength"
    raise ValueError(
        f"'{bound}' at {where} is not supported beside '{shape[0]}': the grammar would "
        f"enforce only the '{shape[0]}'"
    )


#: The ``format`` values the grammar enforces (xgrammar 0.2.9), with the shortest and longest
#: value of each (None: unbounded); beside one of them the grammar drops ``pattern`` and the
#: length bounds, so only bounds these lengths imply are accepted. Other formats are annotations
#: it ignores.
FORMAT_LENGTHS: dict[str, tuple[int, int | None]] = {
    "email": (3, None), "date": (10, 10), "time": (8, None), "date-time": (19, None),
    "duration": (3, None), "ipv4": (7, 15), "ipv6": (2, 45), "hostname": (1, None),
    "uuid": (36, 36), "uri": (2, None), "uri-reference": (0, None), "uri-template": (0, None),
    "json-pointer": (0, None), "relative-json-pointer": (1, None),
}  # fmt: skip
#: A ``maxLength`` from here on beside a format / pattern is accepted but not enforced: no
#: reply writes a value that long before ``max_tokens`` cuts it (pydantic's ``HttpUrl`` writes
#: ``"format": "uri", "maxLength": 2083``).
UNENFORCED_MAX_LENGTH = 1000


#: The keywords a ``const`` / ``enum`` value is checked against (the grammar emits the listed
#: values and ignores the rest); keywords holding subschemas are left out (their ``$ref`` s
#: point into the whole schema).
_VALUE_KEYWORDS = (
    "type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "minLength", "maxLength", "pattern", "minItems", "maxItems", "minProperties",
    "maxProperties", "required",
)  # fmt: skip


def _integer_multiple(step: Any, types: Any) -> bool:
    """Whether the grammar enforces a ``multipleOf`` of ``step`` on a schema of ``types``: an
    integer step where the numbers are integers (``"integer"``, or ``["integer", "null"]``)."""
    types = [types] if isinstance(types, str) else types
    return (
        isinstance(step, int)
        and not isinstance(step, bool)
        and isinstance(types, list)
        and "integer" in types
        and set(types) <= {"integer", "null"}
    )


def _keep_valid_values(out: dict[str, Any], where: str) -> None:
    """Keep (in place) only the ``const`` / ``enum`` values that also satisfy the schema's
    other value keywords: the grammar emits a listed value whatever the rest says
    (``{"type": "string", "const": 5}`` gave ``5``). Validated with ``jsonschema``; a value
    it cannot judge is kept.

    Raises:
        Unsatisfiable: no listed value satisfies the other keywords.
    """
    rest = {k: out[k] for k in _VALUE_KEYWORDS if k in out}
    if not rest:
        return
    validator = jsonschema.Draft202012Validator(rest)

    def ok(value: Any) -> bool:
        try:
            return bool(validator.is_valid(value))
        except Exception:  # noqa: BLE001 - a malformed keyword: leave the value to the grammar
            return True

    key = "const" if "const" in out else "enum"
    values = [out["const"]] if key == "const" else out["enum"]
    if not isinstance(values, list):
        return  # not a list: xgrammar refuses it
    kept = [v for v in values if ok(v)]
    if not kept:
        raise Unsatisfiable(
            f"'{key}' at {where}: no value of it satisfies the other keywords "
            f"({', '.join(rest)}): the schema matches no value"
        )
    if key == "enum":
        out["enum"] = kept


def _complete_object(out: dict[str, Any], where: str) -> None:
    """Give ``out`` (in place) the properties that JSON Schema allows by default and that
    ``required`` needs (module docstring: strict mode).

    Raises:
        ValueError: a ``required`` name outside ``properties`` where ``additionalProperties``
            is false ("matches no value") or ``patternProperties`` may decide its schema; a
            ``minProperties`` above the number of ``properties``.
    """
    props = out.get("properties")
    props = dict(props) if isinstance(props, dict) else {}
    required = out.get("required")
    missing = (
        [r for r in required if isinstance(r, str) and r not in props]
        if isinstance(required, list)
        else []
    )
    extra = out.get("additionalProperties", True)
    if missing:
        if "patternProperties" in out:
            raise ValueError(
                f"'required' at {where} names {missing[0]!r}, which is not in "
                "'properties': not supported beside 'patternProperties'"
            )
        if extra is False:
            raise Unsatisfiable(
                f"'required' at {where} names {missing[0]!r}, which "
                "'additionalProperties': false forbids: the schema matches no value"
            )
        for name in missing:
            props[name] = extra if isinstance(extra, dict) else {}
        out["properties"] = props
    min_props = out.get("minProperties")
    if isinstance(min_props, int) and min_props > len(props):
        # Only additional or pattern keys could make up the count, and the grammar does not
        # keep keys distinct: {"x": 0, "x": 1} parses to one property.
        raise ValueError(
            f"'minProperties' at {where} is not supported above the number of 'properties' "
            f"({min_props} > {len(props)}): the grammar cannot keep other keys distinct"
        )


def _merge_all_of(node: dict[str, Any], where: str) -> dict[str, Any]:
    """``node`` with its ``allOf`` schemas' keywords moved into it, when no keyword appears
    twice with different values (the conjunction is then the merged schema itself)."""
    parts = node["allOf"]
    if not isinstance(parts, list) or not parts:
        return dict(node)
    if len(parts) == 1:  # merged when it can be (its keywords then meet the parent's type)
        one = parts[0]
        if not isinstance(one, dict) or "$ref" in one or "allOf" in one or any(
            k in node and node[k] != v for k, v in one.items()
        ):
            return dict(node)  # xgrammar reads one schema as is (pydantic's $ref wrapper)
    merged = {k: v for k, v in node.items() if k != "allOf"}
    for part in parts:
        if not isinstance(part, dict) or "$ref" in part or "allOf" in part:
            raise ValueError(
                f"'allOf' at {where} is not supported with several schemas unless they are "
                "plain objects that share no keyword"
            )
        for key, value in part.items():
            if key in merged and merged[key] != value:
                raise ValueError(
                    f"'allOf' at {where} is not supported with several schemas that share the "
                    f"keyword '{key}'"
                )
            merged[key] = value
    return merged


def _escape(name: str) -> str:
    """A JSON-pointer reference token (RFC 6901: '~' -> '~0', '/' -> '~1')."""
    return name.replace("~", "~0").replace("/", "~1")
