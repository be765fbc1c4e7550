"""Values written as text, read by the whole JSON schema (no SGLang needed)."""

from __future__ import annotations

from typing import Any

import pytest

from engine.profiles.parsers import get_tool_parser
from engine.profiles.parsers.base import typed_call
from engine.profiles.parsers.values import BadArgument, Branch, Reading, branches_of, read_value

ROOT = {"$defs": {"Name": {"type": "string"}}, "definitions": {"Count": {"type": "integer"}}}
PLAIN = Reading()


def read(raw: str, schema: Any, reading: Reading = PLAIN) -> Any:
    return read_value("x", raw, schema, ROOT, reading)


def test_the_branches_of_a_schema_in_order() -> None:
    assert branches_of({"type": ["integer", "string"]}) == [Branch("integer"), Branch("string")]
    assert branches_of({"type": "integer", "nullable": True}) == [Branch("integer"), Branch("null")]
    assert branches_of({"$ref": "#/$defs/Name"}, ROOT) == [Branch("string")]
    assert branches_of({"enum": [1, "a", True, 2]}) == [Branch("integer", (1, 2)), Branch("string", ("a",)), Branch("boolean", (True,))]
    assert branches_of({"type": "string", "enum": ["a", 1]}) == [Branch("string", ("a",))]
    assert branches_of({"anyOf": [{"type": "number"}, {"$ref": "#/definitions/Count"}]}, ROOT) == [Branch("number"), Branch("integer")]
    assert branches_of({"allOf": [{"type": ["integer", "string"]}, {"type": "number"}]}) == [Branch("integer")]
    assert branches_of({"description": "anything"}) is None
    assert branches_of({"$ref": "#/$defs/Missing"}, ROOT) is None


def test_a_value_is_decoded_only_where_the_schema_admits_its_type() -> None:
    assert read("7", {"type": ["integer", "string"]}) == 7
    assert read("7", {"type": ["string", "integer"]}) == "7"  # in order: the string first
    assert read("7", {"const": "7"}) == "7" and read("true", {"$ref": "#/$defs/Name"}) == "true"
    assert read("7", {"enum": ["7", 8]}) == "7" and read("8", {"enum": ["7", 8]}) == 8
    assert read("null", {"type": ["string", "null"]}) is None and read("nil", {"type": ["integer", "null"]}) is None
    assert read("[1, 2]", {"anyOf": [{"type": "array"}, {"type": "string"}]}) == [1, 2]
    assert read("hello", {"type": "string"}) == "hello" and read('"hello"', {"type": "string"}) == '"hello"'


def test_text_the_schema_takes_only_loosely_is_read_loosely() -> None:
    assert read('"7"', {"type": "integer"}) == 7  # a quoted number, where no string is admitted
    assert read('"7"', {"type": ["integer", "string"]}) == '"7"'  # ...but where one is, the text stays
    assert read("True", {"type": "boolean"}) is True
    assert read("1e3", {"type": "integer"}) == 1000
    assert read('[{\\"id\\": 1}]', {"type": "array"}) == [{"id": 1}]  # JSON whose quotes the model escaped
    assert read("{'a': 1}", {"type": "object"}) == {"a": 1}  # a Python literal
    assert read("None", {"type": ["integer", "null"]}) is None


@pytest.mark.parametrize(("raw", "schema", "says"), [
    ("soon", {"type": "integer"}, "argument 'x' must be an integer, got 'soon'"),
    ("b", {"enum": ["a", 1]}, 'argument \'x\' must be one of "a" or one of 1, got \'b\''),
    ("1.5", {"type": ["integer", "null"]}, "must be an integer or null"),
    ("{", {"type": "object"}, "must be a JSON object"),
    ("NaN", {"type": "number"}, "must be a number"),
    ("8", {"const": 7.5}, "must be one of 7.5"),
])
def test_a_value_that_fits_no_branch_is_refused_naming_the_argument(raw: str, schema: Any, says: str) -> None:
    with pytest.raises(BadArgument, match=None) as err:
        read(raw, schema)
    assert says in str(err.value)


def test_family_readings_where_the_schema_leaves_a_choice() -> None:
    glm47 = get_tool_parser("glm47").values  # type: ignore[attr-defined]
    assert read("7", {"type": ["string", "integer"]}, glm47) == 7  # GLM-4.7 tries typed branches first
    assert read('"hi"', {"type": "string"}, glm47) == "hi"  # ...and reads a JSON string literal without its quotes
    qwen = get_tool_parser("qwen3_coder").values  # type: ignore[attr-defined]
    assert read("7", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, qwen) == "7"  # a union with a string: the string
    assert read("null", {"description": "untyped"}, qwen) is None and read("7", {}, qwen) == "7"
    minimax = get_tool_parser("minimax-m2").values  # type: ignore[attr-defined]
    assert read("yes", {"type": "boolean"}, minimax) is True and read("none", {"type": ["integer", "null"]}, minimax) is None
    glm45 = get_tool_parser("glm45").values  # type: ignore[attr-defined]
    assert read("True", {}, glm45) is True and read("[1]", {}, glm45) == [1]  # undeclared: JSON or a Python literal


def test_a_root_union_of_object_shapes_is_read_by_the_shape_the_call_picks() -> None:
    shapes = {"shapes": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "size": {"type": "integer"}}},
        {"type": "object", "properties": {"kind": {"const": "label"}, "size": {"type": "string"}}},
    ]}}
    reading = Reading(typed_first=True)
    assert typed_call("shapes", [("kind", "circle"), ("size", "7")], shapes, reading).arguments == {"kind": "circle", "size": 7}
    assert typed_call("shapes", [("kind", "label"), ("size", "7")], shapes, reading).arguments == {"kind": "label", "size": "7"}
    refused = typed_call("shapes", [("kind", "circle"), ("size", "big")], shapes, reading)
    assert refused.error == "bad_arguments" and "'size'" in refused.detail


def test_an_argument_given_twice_is_refused() -> None:
    call = typed_call("f", [("a", "1"), ("a", "2")], {"f": {"properties": {"a": {"type": "integer"}}}})
    assert call.error == "bad_arguments" and "given twice" in call.detail
