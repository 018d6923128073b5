"""check_schema: JSON-schema keywords the grammar cannot enforce are refused with their path, and
an allOf of keyword-disjoint schemas is merged into its parent."""

from __future__ import annotations

import copy
import re

import pytest

from pagedllm.structured.schema_check import UNENFORCED_KEYWORDS, check_schema, rebase_local_refs


@pytest.mark.parametrize("keyword", UNENFORCED_KEYWORDS)
def test_unenforced_keyword_is_refused_with_its_path(keyword: str) -> None:
    schema = {"type": "object", "properties": {"a/b": {"type": "integer", keyword: {}}}}
    with pytest.raises(ValueError, match=rf"'{keyword}' at /properties/a~1b is not supported"):
        check_schema(schema)


@pytest.mark.parametrize(
    ("schema", "path"),
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "/"),
        ({"type": "array", "items": {"type": "array", "uniqueItems": True}}, "/items"),
        ({"anyOf": [{"type": "string"}, {"type": "array", "uniqueItems": True}]}, "/anyOf/1"),
        ({"$defs": {"x": {"type": "array", "uniqueItems": True}}, "$ref": "#/$defs/x"}, "/$defs/x"),
        ({"type": "array", "prefixItems": [{"type": "array", "uniqueItems": True}]}, "/prefixItems/0"),
        ({"type": "array", "items": [{"type": "array", "uniqueItems": True}]}, "/items/0"),
    ],
)
def test_unique_items_is_refused_wherever_it_sits(schema: dict, path: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"'uniqueItems' at {path} is not supported")):
        check_schema(schema)


def test_unique_items_false_and_annotations_pass_unchanged() -> None:
    schema = {"type": "array", "uniqueItems": False, "items": {"type": "string", "format": "email",
              "contentEncoding": "base64", "description": "not", "title": "if"}}
    assert check_schema(schema) == schema


def test_disjoint_all_of_is_merged_and_the_input_kept() -> None:
    schema = {"properties": {"n": {"allOf": [{"type": "integer"}, {"minimum": 1000}]}},
              "type": "object", "required": ["n"]}
    before = copy.deepcopy(schema)
    merged = check_schema(schema)
    assert merged["properties"]["n"] == {"type": "integer", "minimum": 1000}
    assert schema == before
    # a single plain schema merges too (a $ref wrapper stays); equal repeated keywords merge
    assert check_schema({"allOf": [{"type": "string"}]}) == {"type": "string"}
    assert check_schema({"type": "integer", "allOf": [{"type": "integer"}, {"maximum": 3}]}) == {
        "type": "integer", "maximum": 3}


@pytest.mark.parametrize(
    "all_of",
    [
        [{"minimum": 1}, {"minimum": 5}],
        [{"type": "integer"}, {"$ref": "#/$defs/x"}],
        [{"type": "integer"}, {"allOf": [{"minimum": 1}, {"maximum": 2}]}],
        [{"type": "integer"}, True],
    ],
)
def test_overlapping_all_of_is_refused(all_of: list) -> None:
    with pytest.raises(ValueError, match="'allOf' at /properties/x is not supported"):
        check_schema({"type": "object", "properties": {"x": {"allOf": all_of}}})


def test_a_merged_all_of_is_checked_too() -> None:
    with pytest.raises(ValueError, match="'not' at / is not supported"):
        check_schema({"allOf": [{"type": "integer"}, {"not": {"const": 3}}]})


def test_keyword_names_as_property_names_or_values_pass() -> None:
    """Only keywords of a schema count: a property called "not" or "if", an enum or const value
    holding such a key, and a default are data."""
    schema = {
        "type": "object",
        "properties": {"not": {"type": "boolean"}, "if": {"enum": [{"not": 1}, "then"]},
                       "uniqueItems": {"const": {"uniqueItems": True}, "default": {"else": 2}}},
        "required": ["not", "if"],
    }
    assert check_schema(schema) == schema


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"anyOf": []}, "'anyOf' at / is an empty list: the schema matches no value"),
        ({"oneOf": []}, "'oneOf' at / is an empty list"),
        ({"type": "object", "properties": {"a": {"anyOf": []}}}, "'anyOf' at /properties/a is an empty"),
        ({"type": []}, "'type' at / is an empty list"),
        ({"$ref": "https://example.com/x.json#/defs/y"}, "'$ref' at / is not supported"),
        ({"type": "object", "properties": {"a": {"$ref": "s.json"}}}, "'$ref' at /properties/a is not"),
        ({"type": "string", "pattern": "(?=a)b"}, "'pattern' at / is not supported"),
        ({"type": "string", "pattern": "^(?!b)b$"}, "'pattern' at / is not supported"),
        ({"items": {"type": "string", "pattern": "(?<=x)y"}}, "'pattern' at /items is not"),
        ({"items": {"type": "string", "pattern": "(?<!x)y"}}, "'pattern' at /items is not"),
        ({"type": "string", "pattern": "a^b"}, "'pattern' at / is not supported: '^' is"),
        # the grammar keeps only the format (else the pattern) and drops the rest
        ({"type": "string", "minLength": 3, "pattern": "^a$"}, "'minLength' at / is not supported beside 'pattern'"),
        ({"type": "string", "maxLength": 9, "pattern": "^a+$"}, "'maxLength' at / is not supported beside 'pattern'"),
        ({"type": "string", "format": "email", "maxLength": 50}, "'maxLength' at / is not supported beside 'format'"),
        ({"type": "string", "format": "date", "maxLength": 3}, "'maxLength' at / is not supported beside 'format'"),
        ({"type": "string", "format": "date", "pattern": "a"}, "'pattern' at / is not supported beside 'format'"),
        # multipleOf: enforced only as an integer step on integers
        ({"type": "number", "multipleOf": 3, "minimum": 1}, "'multipleOf' at / is not supported"),
        ({"properties": {"x": {"multipleOf": 0.5}}}, "'multipleOf' at /properties/x is not"),
        ({"type": "integer", "multipleOf": 1.5}, "'multipleOf' at / is not supported"),
        # a const / enum none of whose values satisfies the other keywords
        ({"type": "string", "const": 5}, "'const' at /: no value of it satisfies the other keywords (type)"),
        ({"type": "integer", "enum": ["a", "b"]}, "'enum' at /: no value of it"),
        ({"properties": {"n": {"enum": [1, 2], "minimum": 3}}}, "'enum' at /properties/n: no value"),
    ],
)
def test_schemas_the_grammar_would_misread_are_refused(schema: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        check_schema(schema)


def test_local_refs_plain_patterns_and_keyword_named_properties_pass() -> None:
    schema = {
        "$defs": {"x": {"type": "string", "pattern": "^(ab)+(?:c|d)$"}},
        "type": "object",
        "properties": {"r": {"$ref": "#/$defs/x"}, "pattern": {"type": "string"},
                       "type": {"enum": [[], {"$ref": "http://x"}]}, "$ref": {"const": "(?=a)"}},
    }
    assert check_schema(schema) == schema


@pytest.mark.parametrize(
    ("schema", "want"),
    [
        # a required name outside properties: added with additionalProperties' schema, else any
        ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "zz"]},
         {"type": "object", "properties": {"a": {"type": "integer"}, "zz": {}},
          "required": ["a", "zz"]}),
        ({"type": "object", "required": ["zz"], "additionalProperties": {"type": "integer"}},
         {"type": "object", "required": ["zz"], "additionalProperties": {"type": "integer"},
          "properties": {"zz": {"type": "integer"}}}),
        # minProperties the declared properties can meet stays
        ({"type": "object", "properties": {"a": {}}, "minProperties": 1},
         {"type": "object", "properties": {"a": {}}, "minProperties": 1}),
    ],
)
def test_objects_get_the_properties_required_needs(schema, want) -> None:
    kept = copy.deepcopy(schema)
    assert check_schema(schema) == want
    assert schema == kept


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "object", "required": ["zz"], "additionalProperties": False},
         "'required' at / names 'zz', which 'additionalProperties': false forbids"),
        ({"type": "object", "required": ["zz"], "patternProperties": {"^z": {"type": "integer"}}},
         "'required' at / names 'zz', which is not in 'properties'"),
        # only additional / pattern keys could make up the count, and the grammar may repeat
        # one ({"x": 0, "x": 1} parses to one property)
        ({"type": "object", "minProperties": 2}, "'minProperties' at / is not supported"),
        ({"type": "object", "properties": {"a": {}}, "minProperties": 2,
          "additionalProperties": {"type": "integer"}}, "'minProperties' at / is not supported"),
        ({"items": {"type": "object", "patternProperties": {"^x": {}}, "minProperties": 1}},
         "'minProperties' at /items is not supported"),
    ],
)
def test_objects_the_grammar_cannot_complete_are_refused(schema, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        check_schema(schema)


def test_rebase_local_refs_moves_schema_refs_and_keeps_data() -> None:
    schema = {
        "$defs": {"C": {"type": "object", "properties": {"x": {"$ref": "#/$defs/C"}}}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/C"}, "b": {"anyOf": [{"$ref": "#"}]},
                       "c": {"const": {"$ref": "#/data"}, "default": {"$ref": "#"}},
                       "e": {"$ref": "other.json#/x"}},
    }
    kept = copy.deepcopy(schema)
    got = rebase_local_refs(schema, "/items/anyOf/0")
    assert got["properties"]["a"] == {"$ref": "#/items/anyOf/0/$defs/C"}
    assert got["$defs"]["C"]["properties"]["x"] == {"$ref": "#/items/anyOf/0/$defs/C"}
    assert got["properties"]["b"] == {"anyOf": [{"$ref": "#/items/anyOf/0"}]}
    assert got["properties"]["c"] == schema["properties"]["c"]  # const / default are data
    assert got["properties"]["e"] == {"$ref": "other.json#/x"}  # not local: refused elsewhere
    assert schema == kept


def test_a_branch_that_matches_no_value_is_dropped_from_any_of() -> None:
    """It could never be the branch a value matches; the schema was refused whole."""
    never = {"type": "object", "properties": {}, "required": ["b"], "additionalProperties": False}
    assert check_schema({"anyOf": [never, {"type": "integer"}]}) == {"anyOf": [{"type": "integer"}]}
    assert check_schema({"oneOf": [{"anyOf": []}, {"type": "string"}]}) == {
        "oneOf": [{"type": "string"}]
    }
    with pytest.raises(ValueError, match=re.escape("no branch of 'anyOf' at / matches a value")):
        check_schema({"anyOf": [never, {"type": []}]})


def test_integer_steps_on_integers_and_listed_values_pass() -> None:
    for schema in ({"type": "integer", "multipleOf": 3}, {"type": ["integer", "null"], "multipleOf": 2}):
        assert check_schema(schema) == schema
    # with const / enum the listed values are checked against it instead
    assert check_schema({"type": "number", "multipleOf": 0.5, "enum": [1.5, 1.2]})["enum"] == [1.5]


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083},  # pydantic HttpUrl
        {"type": "string", "format": "uuid", "minLength": 36, "maxLength": 36},
        {"type": "string", "pattern": "^[A-Z]{3}$", "minLength": 3, "maxLength": 3},
        {"type": "string", "pattern": "^[a-z]+$", "minLength": 1},
    ],
)
def test_length_bounds_the_format_or_pattern_implies_pass(schema: dict) -> None:
    assert check_schema(schema) == schema


def test_merges_a_single_all_of_and_takes_an_integral_float_step() -> None:
    assert check_schema({"type": "integer", "allOf": [{"multipleOf": 3}]}) == {
        "type": "integer", "multipleOf": 3}
    assert check_schema({"type": "integer", "multipleOf": 5.0})["multipleOf"] == 5
    wrapper = {"allOf": [{"$ref": "#/$defs/x"}], "description": "d", "$defs": {"x": {}}}
    assert check_schema(wrapper) == wrapper  # pydantic's $ref wrapper stays as it is


def test_formats_the_grammar_ignores_keep_their_length_bounds() -> None:
    schema = {"type": "string", "format": "password", "minLength": 8}
    assert check_schema(schema) == schema  # "password" is an annotation: the length holds
    with pytest.raises(ValueError, match="'maxLength' at / is not supported beside 'format'"):
        check_schema({"type": "string", "format": "uuid", "maxLength": 8})


def test_enum_values_that_break_the_schema_are_dropped() -> None:
    schema = {"type": "object", "properties": {
        "n": {"type": "integer", "enum": [1, 2, "x", 3.5], "minimum": 2},
        "s": {"enum": [1, "a", None], "type": "string"},
        "c": {"type": ["string", "null"], "const": None},
    }}
    got = check_schema(schema)["properties"]
    assert got["n"]["enum"] == [2] and got["s"]["enum"] == ["a"] and got["c"]["const"] is None
    assert schema["properties"]["n"]["enum"] == [1, 2, "x", 3.5]  # the input is kept
