"""The engine's reading of model turns against SGLang's own parsers, turn by turn (formats_corpus.py).

SGLang's readings come from `tools/sglang_oracle.py`, run in a scratch venv holding
sglang==0.5.23 (.ci/run builds it and sets FSM_SGLANG_ORACLE to the JSON it writes). Without
that file the tests skip, saying how to make it. Three oracles, one file:

- tool-call cases: SGLang's function-call detector of each name, against the engine's parser;
- typed values: one argument written as text, for every schema shape and many spellings. The two
  readings are judged by the schema itself (`jsonschema`), not by either reader. They agree,
  or the difference is one of these, each shown case by case:
  `no_fit`: no reading of the text fits the schema (as written, JSON, a Python literal, escaped
  JSON); the engine answers `bad_arguments` naming the argument, SGLang passes on what it made;
  `sglang_breaks_schema`: SGLang's value does not fit the schema, the engine's does;
  `sglang_rewrites`: the schema takes the text as a string; SGLang re-renders it as Python or
  JSON prints a value (`true` -> `True`, `{"a":1}` -> `{"a": 1}`), the engine keeps what the
  model wrote;
  `sglang_loses_value`: SGLang's MiniMax detector reads every value of a nullable parameter as
  null; the engine reads the value;
- served turns: SGLang's reasoning parser (forced as the prompt says) then its detector, as a
  chat completion is served, against the engine's `read_turn`: reasoning, content and calls.
"""

from __future__ import annotations

import ast
import json
import os
from collections import Counter
from typing import Any

import jsonschema
import pytest

from engine.profiles.parsers import get_reasoning_parser, get_tool_parser, native_parser_names, read_turn
from engine.profiles.parsers.reasoning import native_reasoning_names
from tests.profiles.formats_corpus import (
    BRIDGED, BRIDGED_REASONING, TOOL_SETS, TYPED, TYPED_SCHEMAS, TYPED_TOOL, cases, reasoning_cases, typed_cases,
)

ORACLE = os.environ.get("FSM_SGLANG_ORACLE")
SCHEMAS = {name: {t["function"]["name"]: t["function"]["parameters"] for t in tools} for name, tools in TOOL_SETS.items()}
CASES = cases()
SERVED = reasoning_cases()
TYPED_CASES = typed_cases()
DECLARED = ("no_fit", "sglang_breaks_schema", "sglang_rewrites", "sglang_loses_value")


@pytest.fixture(scope="module")
def oracle() -> dict[str, Any]:
    if not ORACLE or not os.path.isfile(ORACLE):
        pytest.skip("SGLang's readings are not here: run tools/sglang_oracle_venv.sh VENV PYTHON, then "
                    "VENV/bin/python tools/sglang_oracle.py OUT.json and set FSM_SGLANG_ORACLE=OUT.json (.ci/run does)")
    with open(ORACLE, encoding="utf-8") as f:
        data = json.load(f)
    assert data["sglang"] == "0.5.23", "the corpus's expectations were written against SGLang 0.5.23"
    return data


@pytest.fixture(scope="module")
def readings(oracle: dict[str, Any]) -> dict[str, Any]:
    return oracle["readings"]


@pytest.mark.parametrize("name", sorted(BRIDGED))
def test_a_name_the_engine_does_not_read_natively_works_through_sglang(name: str, oracle: dict[str, Any]) -> None:
    """Run by the oracle inside the SGLang venv: `get_tool_parser(name)` there is SGLang's detector."""
    bridged = oracle["bridged"]
    assert "raised" not in bridged, bridged
    assert name not in native_parser_names()
    assert bridged[name]["parser"] == "SGLangDetectorParser"
    assert bridged[name]["calls"] == [["code_interpreter", {"code": "print(6*7)"}, None]]


@pytest.mark.parametrize("name", sorted(BRIDGED_REASONING))
def test_a_reasoning_name_the_engine_does_not_read_natively_works_through_sglang(name: str, oracle: dict[str, Any]) -> None:
    bridged = oracle["bridged"]
    assert "raised" not in bridged, bridged
    assert name not in native_reasoning_names()
    _, reasoning, content, start = BRIDGED_REASONING[name]
    assert bridged[f"reasoning:{name}"] == {"parser": "SGLangReasoning", "start": start, "split": [reasoning, content]}


def _sglang_calls(reading: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(c["name"], json.loads(c["parameters"])) for c in reading["calls"]]


def _sglang_args_parse(reading: dict[str, Any]) -> bool:
    try:
        _sglang_calls(reading)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_engine_reads_the_turn_as_sglang_does(case: dict[str, Any], readings: dict[str, Any]) -> None:
    theirs = readings[case["id"]]
    assert "raised" not in theirs, f"SGLang's detector raised: {theirs['raised']}"
    ours = get_tool_parser(case["parser"]).parse(case["text"], SCHEMAS[case["tools"]])
    expect = case["expect"]
    if expect == "agree/no_call":  # an answer: no call either side, the same content
        assert ours.calls == () and theirs["calls"] == [] and ours.content == theirs["normal_text"], (ours, theirs)
        return
    if expect.startswith("agree"):
        assert ours.calls, "a well-formed call must be read"
        assert all(c.error is None for c in ours.calls), ours.calls
        assert [(c.name, c.arguments) for c in ours.calls] == _sglang_calls(theirs)
        if expect == "agree/stop_in_sglang_text":
            assert ours.content == "" and theirs["normal_text"].strip() in ("</s>", "|eot_id|>", "|eom_id|>"), theirs
        else:
            assert ours.content == theirs["normal_text"], (ours.content, theirs["normal_text"])
        return
    if expect == "text":  # no call in it for either: the turn is an answer
        assert ours.calls == () and theirs["calls"] == [], (ours, theirs)
        return
    if expect == "engine_reads":  # a well-formed call SGLang's detector misses: the engine runs it
        assert theirs["calls"] == [], theirs
        assert [(c.name, c.arguments, c.error) for c in ours.calls] == [("code_interpreter", {"code": "print(6*7)"}, None)]
        return
    if expect == "engine_fits/sglang_breaks_schema":  # the same call; SGLang's arguments break the tool's schema
        params = SCHEMAS[case["tools"]][ours.calls[0].name]
        (name, args), = _sglang_calls(theirs)
        assert [c.error for c in ours.calls] == [None] and ours.calls[0].name == name
        assert jsonschema.Draft202012Validator(params).is_valid(ours.calls[0].arguments)
        assert not jsonschema.Draft202012Validator(params).is_valid(args), args
        return
    if expect == "unknown_tool":
        # the engine keeps the call (the loop answers unknown_tool); SGLang drops it or keeps it
        assert [(c.name, c.error) for c in ours.calls] == [("web_search", None)]
        assert [n for n, _ in _sglang_calls(theirs)] in ([], ["web_search"])
        return
    kind, _, sglang = expect.partition("/")
    assert kind == "engine_error"
    assert ours.calls and any(c.error for c in ours.calls), f"the engine must answer an error, read {ours}"
    if sglang == "no_call":  # SGLang would have taken the turn as text: the call lost
        assert theirs["calls"] == [], theirs
    elif sglang == "damaged_call":  # a call comes back, but not the one the model meant
        assert theirs["calls"], theirs
        meant = [tuple(c) for c in case["meant"]]
        assert not _sglang_args_parse(theirs) or _sglang_calls(theirs) != meant, theirs
    elif sglang == "string_kept":
        assert [c.error for c in ours.calls] == ["bad_arguments"] and "'days'" in ours.calls[0].detail
        assert _sglang_calls(theirs) == [("lookup", {"city": "Oslo", "days": "soon"})]
    else:
        raise AssertionError(f"unknown expectation {expect}")


# -- typed values ----------------------------------------------------------------------------

_ROOT = TYPED_TOOL["function"]["parameters"]
_NULL_WORDS = ("null", "none", "nil")


def _fits(value: Any, schema: Any) -> bool:
    """Whether `value` fits `schema` (OpenAPI's `nullable` read as "or null"), by jsonschema."""
    if isinstance(schema, dict) and schema.get("nullable") is True:
        schema = {"anyOf": [schema, {"type": "null"}]}
    document = {**schema, "$defs": _ROOT["$defs"], "definitions": _ROOT["definitions"]}
    return jsonschema.Draft202012Validator(document).is_valid(value)


def _readings_of(raw: str) -> list[Any]:
    """Every way a reader could take the text: as written, as JSON, as a Python literal, as escaped JSON."""
    found: list[Any] = [raw]
    for read in (json.loads, ast.literal_eval, lambda t: json.loads(json.loads(f'"{t}"'))):
        try:
            found.append(read(raw.strip()))
        except Exception:
            pass
    return found


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON values: 7 and 7.0 are; true and 1 are not."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def classify(raw: str, schema: Any, engine: Any, engine_error: str | None, sglang: Any) -> str:
    """How the engine's reading of one value relates to SGLang's, judged by the schema; a class of
    DECLARED, "agree", or a sentence saying what is wrong."""
    if engine_error is not None:
        if any(_fits(r, schema) for r in _readings_of(raw)):
            return f"undeclared: the engine refused a value that fits ({engine_error})"
        return "no_fit"
    if not _fits(engine, schema):
        return f"wrong: the engine's {engine!r} does not fit the schema"
    if _same(engine, sglang):
        return "agree"
    if not _fits(sglang, schema):
        return "sglang_breaks_schema"
    if isinstance(sglang, str) and sglang != raw and any(
            sglang in (str(r), json.dumps(r, ensure_ascii=False)) for r in _readings_of(raw)[1:]):
        return "sglang_rewrites"
    if sglang is None and raw.strip().lower() not in _NULL_WORDS and engine is not None:
        return "sglang_loses_value"
    return f"undeclared: both fit, the engine read {engine!r}, SGLang {sglang!r}"


@pytest.mark.parametrize("parser", TYPED)
@pytest.mark.parametrize("argument", sorted(TYPED_SCHEMAS))
def test_a_value_written_as_text_is_read_as_sglang_reads_it_or_by_the_schema(parser: str, argument: str,
                                                                          oracle: dict[str, Any]) -> None:
    schema = TYPED_SCHEMAS[argument]
    found: Counter[str] = Counter()
    wrong = []
    for case in (c for c in TYPED_CASES if c["parser"] == parser and c["argument"] == argument):
        theirs = oracle["typed"][case["id"]]
        assert "raised" not in theirs and len(theirs["calls"]) == 1, theirs
        sglang = json.loads(theirs["calls"][0]["parameters"]).get(argument, "<missing>")
        (call,) = get_tool_parser(parser).parse(case["text"], SCHEMAS["typed"]).calls
        engine = None if call.error else call.arguments[argument]
        if call.error is not None:
            assert call.error == "bad_arguments" and repr(argument) in call.detail, call
        verdict = classify(case["raw"], schema, engine, call.detail if call.error else None, sglang)
        found[verdict] += 1
        if verdict != "agree" and verdict not in DECLARED:
            wrong.append(f"{case['raw']!r}: {verdict}")
    assert not wrong, "\n".join(wrong)
    TYPED_FOUND[parser].update(found)


TYPED_FOUND: dict[str, Counter[str]] = {p: Counter() for p in TYPED}


# -- served turns: reasoning, then calls ------------------------------------------------------

@pytest.mark.parametrize("case", SERVED, ids=[c["id"] for c in SERVED])
def test_a_turn_is_served_as_sglang_serves_it(case: dict[str, Any], oracle: dict[str, Any]) -> None:
    theirs = oracle["served"][case["id"]]
    assert "raised" not in theirs, f"SGLang raised: {theirs['raised']}"
    ours = read_turn(case["text"], get_tool_parser(case["parser"]), get_reasoning_parser(case["reasoning"]), SCHEMAS["base"],
                     forced=case["forced"])
    calls = [(c.name, c.arguments) for c in ours.calls if c.error is None]
    expect = case["expect"]
    if expect == "content_dropped_by_sglang":  # harmony: text outside any message
        assert theirs == {"reasoning": "", "content": "", "calls": []} and ours.calls == ()
        assert ours.content == case["text"]
        return
    assert ours.reasoning == theirs["reasoning"], (ours.reasoning, theirs["reasoning"])
    assert calls == _sglang_calls(theirs) and all(c.error is None for c in ours.calls), (ours.calls, theirs["calls"])
    if expect == "no_call":  # neither runs it; SGLang's content shows the markup the engine reads as a refused call
        assert ours.calls == () and theirs["calls"] == []
        return
    assert expect == "agree", expect
    assert ours.content == theirs["content"], (ours.content, theirs["content"])


def test_corpus_covers_every_native_family(readings: dict[str, Any], oracle: dict[str, Any]) -> None:
    """N names x M turns, printed for the report; every case read by SGLang."""
    per = Counter(c["parser"] for c in CASES)
    assert len(per) >= 13 and min(per.values()) >= 9
    assert set(readings) == {c["id"] for c in CASES}
    assert set(oracle["typed"]) == {c["id"] for c in TYPED_CASES} and set(oracle["served"]) == {c["id"] for c in SERVED}
    served = Counter(c["reasoning"] for c in SERVED)
    if all(TYPED_FOUND.values()):  # the typed tests ran first: every declared difference is seen, and agreement dominates
        total = sum(TYPED_FOUND.values(), Counter())
        print("\ntyped values:", {p: dict(c) for p, c in TYPED_FOUND.items()})
        assert all(total[k] > 0 for k in DECLARED) and total["agree"] > total["sglang_breaks_schema"]
    print(f"\n{len(per)} parser names x {len(CASES)} turns ({min(per.values())}-{max(per.values())} each); "
          f"{len(TYPED_CASES)} typed values ({len(TYPED)} names x {len(TYPED_SCHEMAS)} schemas); "
          f"{len(SERVED)} served turns ({len(served)} reasoning names)")
