"""Model turns in every native format, for the differential test against SGLang's own parsers.

Imports nothing of the engine: `tools/sglang_oracle.py` reads this module inside a scratch venv
holding SGLang. The shapes follow SGLang's unit tests of its function-call detectors and
reasoning parsers (written here anew). Three kinds of case:

`cases()`: one turn read by one tool-call parser. What is expected:
- "agree": the engine's calls (names, typed arguments) and content equal SGLang's, exactly;
- "agree/stop_in_sglang_text": the calls agree; SGLang's text holds the turn's stop token, the engine's is empty;
- "text": neither reads a call (the turn is an answer);
- "engine_reads": the engine reads a well-formed call SGLang's detector misses (the turn would be text);
- "engine_error/no_call": the engine answers an error observation where SGLang finds no call
  (the call would be lost, the turn taken as text);
- "engine_error/damaged_call": the engine answers an error where SGLang returns a damaged call
  (a truncated value, `{}` for a missing tag, arguments that are not JSON);
- "engine_error/string_kept": the value does not fit the schema; SGLang passes it on as a string,
  the engine names the argument in an error;
- "unknown_tool": the engine reports the call (the loop answers `unknown_tool`); SGLang drops it
  or passes it, by detector.

`typed_cases()`: one argument written as text (`qwen3_coder`, `glm45`, `glm47`, `minimax-m2`),
for every schema of `TYPED_TOOL` and many ways to write a value. The test compares the two
readings by the schema itself (`jsonschema`), as described in test_sglang_differential.py.

`reasoning_cases()`: one turn as SGLang serves it with `--reasoning-parser` and
`--tool-call-parser`: the reasoning split off first (forced or not), then the calls read from
the rest. Expected: "agree" (reasoning, content and calls equal), or one of the declared
differences named there.
"""

from __future__ import annotations

import json
from typing import Any

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "code_interpreter", "description": "Run Python code.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}},
    {"type": "function", "function": {
        "name": "lookup", "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"},
            "options": {"type": "object"}}, "required": ["city"]}}},
]

# Schemas of every shape a value written as text is typed by (SGLang's detector tests' shapes and more).
TYPED_SCHEMAS: dict[str, Any] = {
    "int_or_str": {"type": ["integer", "string"]},
    "str_or_int": {"type": ["string", "integer"]},
    "nullable_str": {"type": ["string", "null"]},
    "nullable_int": {"type": ["integer", "null"]},
    "openapi_nullable": {"type": "integer", "nullable": True},
    "const": {"const": "7"},
    "enum_mixed": {"enum": [1, "a", True, None]},
    "enum_str": {"enum": ["7", "true", "null"]},
    "enum_typed": {"type": ["string", "integer"], "enum": ["7", 8]},
    "ref_str": {"$ref": "#/$defs/Name"},
    "ref_int": {"$ref": "#/definitions/Count"},
    "anyof_str_int": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "anyof_int_str": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    "oneof_obj_str": {"oneOf": [{"type": "object"}, {"type": "string"}]},
    "anyof_num_null": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    "allof_int": {"allOf": [{"type": ["integer", "string"]}, {"type": "integer"}]},
    "string": {"type": "string"},
    "integer": {"type": "integer"},
    "number": {"type": "number"},
    "boolean": {"type": "boolean"},
    "array": {"type": "array"},
    "object": {"type": "object"},
    "untyped": {"description": "anything"},
}
TYPED_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "typed", "description": "Takes one argument of each shape.",
    "parameters": {"type": "object", "properties": TYPED_SCHEMAS,
                   "$defs": {"Name": {"type": "string"}}, "definitions": {"Count": {"type": "integer"}}}}}
# A tool whose arguments are a union of object shapes told apart by `kind` (a root oneOf).
SHAPES_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "shapes", "description": "A circle by radius or a label by text.",
    "parameters": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "size": {"type": "integer"}}, "required": ["kind"]},
        {"type": "object", "properties": {"kind": {"const": "label"}, "size": {"type": "string"}}, "required": ["kind"]},
    ]}}}
# How a model writes values: as JSON, quoted, in Python's spelling, escaped, or as plain text.
TYPED_VALUES = ("7", "-3", "7.0", "1e3", "1.5", '"7"', "true", "True", "yes", "null", "None", "none", "nil", '"hi"', "hi there",
                "[1, 2]", '{"a": 1}', "{'a': 1}", '[{\\"id\\": 1}]', "a")
TOOL_SETS = {"base": TOOLS, "typed": [*TOOLS, TYPED_TOOL, SHAPES_TOOL]}

ONE = [("code_interpreter", {"code": "print(6*7)"})]
TWO = [("code_interpreter", {"code": "x = 2\nprint(x ** 10)"}), ("lookup", {"city": "Paris", "days": 3})]
UNICODE = [("code_interpreter", {"code": "print('héllo 世界 😀')"})]
NESTED = [("lookup", {"city": "北京", "days": 2, "options": {"units": "metric", "fields": ["temp", {"wind": True}]}})]
LEAD = "Let me compute that first."


def _value(v: Any) -> str:
    """How a format that writes values as text writes this one."""
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def _js(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False)


def hermes(calls: list[tuple[str, dict[str, Any]]]) -> str:
    return "\n".join(f"<tool_call>\n{_js({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)


def qwen3_coder(calls: list[tuple[str, dict[str, Any]]]) -> str:
    return "\n".join("<tool_call>\n<function=" + n + ">\n" + "".join(f"<parameter={k}>\n{_value(v)}\n</parameter>\n" for k, v in a.items())
                     + "</function>\n</tool_call>" for n, a in calls)


def glm45(calls: list[tuple[str, dict[str, Any]]]) -> str:
    return "\n".join(f"<tool_call>{n}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{_value(v)}</arg_value>\n" for k, v in a.items())
                     + "</tool_call>" for n, a in calls)


def glm47(calls: list[tuple[str, dict[str, Any]]]) -> str:
    return "".join(f"<tool_call>{n}" + "".join(f"<arg_key>{k}</arg_key><arg_value>{_value(v)}</arg_value>" for k, v in a.items())
                   + "</tool_call>" for n, a in calls)


def llama3(calls: list[tuple[str, dict[str, Any]]]) -> str:
    return ";".join(_js({"name": n, "parameters": a}) for n, a in calls)


def mistral(calls: list[tuple[str, dict[str, Any]]]) -> str:
    return "[TOOL_CALLS] " + _js([{"name": n, "arguments": a, "id": f"a1b2c3d4{i}"} for i, (n, a) in enumerate(calls)])


def pythonic(calls: list[tuple[str, dict[str, Any]]]) -> str:
    return "[" + ", ".join(n + "(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")" for n, a in calls) + "]"


def deepseekv3(calls: list[tuple[str, dict[str, Any]]]) -> str:
    return ("<｜tool▁calls▁begin｜>" + "\n".join(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{_js(a)}\n```<｜tool▁call▁end｜>"
                                               for n, a in calls) + "<｜tool▁calls▁end｜>")


def deepseekv31(calls: list[tuple[str, dict[str, Any]]]) -> str:
    return ("<｜tool▁calls▁begin｜>" + "".join(f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{_js(a)}<｜tool▁call▁end｜>" for n, a in calls)
            + "<｜tool▁calls▁end｜>")


def kimi_k2(calls: list[tuple[str, dict[str, Any]]]) -> str:
    return ("<|tool_calls_section_begin|>" + "".join(
        f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{_js(a)}<|tool_call_end|>" for i, (n, a) in enumerate(calls))
        + "<|tool_calls_section_end|>")


def gpt_oss(calls: list[tuple[str, dict[str, Any]]]) -> str:
    (n, a), = calls  # one call per turn: <|call|> ends it
    return ("<|channel|>analysis<|message|>I should use the tool.<|end|><|start|>assistant<|channel|>commentary "
            f"to=functions.{n} <|constrain|>json<|message|>{_js(a)}<|call|>")


def minimax_m2(calls: list[tuple[str, dict[str, Any]]]) -> str:
    return ("<minimax:tool_call>\n" + "".join(f'<invoke name="{n}">\n' + "".join(
        f'<parameter name="{k}">{_value(v)}</parameter>\n' for k, v in a.items()) + "</invoke>\n" for n, a in calls)
        + "</minimax:tool_call>")


RENDER = {"hermes": hermes, "qwen25": hermes, "qwen3_coder": qwen3_coder, "glm45": glm45, "glm47": glm47, "llama3": llama3,
          "mistral": mistral, "pythonic": pythonic, "deepseekv3": deepseekv3, "deepseekv31": deepseekv31, "kimi_k2": kimi_k2,
          "gpt-oss": gpt_oss, "minimax-m2": minimax_m2}
# The token a turn with a call ends on, when the server leaves it in the text.
STOP = {"hermes": "<|im_end|>", "qwen25": "<|im_end|>", "qwen3_coder": "<|im_end|>", "glm45": "<|observation|>",
        "glm47": "<|observation|>", "llama3": "<|eot_id|>", "mistral": "</s>", "pythonic": "<|eot|>",
        "deepseekv3": "<｜end▁of▁sentence｜>", "deepseekv31": "<｜end▁of▁sentence｜>", "kimi_k2": "<|im_end|>",
        "minimax-m2": "[e~[", "gpt-oss": ""}
# A malformed call in each format, and what SGLang makes of it.
MALFORMED = {
    "hermes": ('<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(1)"}\n</tool_call>', "no_call"),
    "qwen25": ('<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(1)"}\n</tool_call>', "no_call"),
    "qwen3_coder": ("<tool_call>\n<function=code_interpreter\n<parameter=code>\nprint(1)\n</parameter>\n</function>\n</tool_call>",
                    "damaged_call"),
    "glm45": ("<tool_call>code_interpreter\n<arg_key>code</arg_key>\n<arg_value>print(1)\n</tool_call>", "damaged_call"),
    "glm47": ("<tool_call>code_interpreter<arg_key>code</arg_key><arg_value>print(1)</tool_call>", "damaged_call"),
    "llama3": ('<|python_tag|>{"name": "code_interpreter", "parameters": {"code": "print(1)"}', "no_call"),
    "mistral": ('[TOOL_CALLS] [{"name": "code_interpreter", "arguments": {"code": "print(1)"}]', "no_call"),
    "pythonic": ("[code_interpreter(code='print(1)')", "no_call"),
    "deepseekv3": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>code_interpreter\n```json\n{\"code\": print(1)}\n```"
                   "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "no_call"),
    "deepseekv31": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>code_interpreter<｜tool▁sep｜>{\"code\": print(1)}<｜tool▁call▁end｜>"
                    "<｜tool▁calls▁end｜>", "no_call"),
    "kimi_k2": ("<|tool_calls_section_begin|><|tool_call_begin|>functions.code_interpreter:0<|tool_call_argument_begin|>"
                "{\"code\": print(1)}<|tool_call_end|><|tool_calls_section_end|>", "damaged_call"),
    "gpt-oss": ("<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant<|channel|>commentary to=functions.code_interpreter "
                "<|constrain|>json<|message|>{\"code\": print(1)}<|call|>", "no_call"),
    "minimax-m2": ('<minimax:tool_call>\n<invoke name="code_interpreter">\n<parameter name="code">print(1)</parameter>\n</invoke>\n',
                   "no_call"),
}
# Where SGLang reads a call cut by a stop string (text ending inside the call) as something.
CUT_SGLANG = {"qwen3_coder": "damaged_call", "llama3": "no_call", "gpt-oss": "no_call"}
TYPED = ("qwen3_coder", "glm45", "glm47", "minimax-m2")  # formats that write values as text


def _lead(parser: str, calls: str) -> str:
    """Text before the calls, as each format writes it."""
    if parser == "llama3":
        return f"{LEAD}<|python_tag|>{calls}"
    if parser == "gpt-oss":  # a commentary preamble before the call
        head, sep, call = calls.partition("<|start|>assistant")
        return f"{head}{sep}<|channel|>commentary<|message|>{LEAD}<|end|>{sep}{call}"
    return f"{LEAD}\n{calls}"


def _cut(text: str) -> str:
    """The turn as a stop string inside the call's last value leaves it."""
    at = text.rfind("6*7")
    return text[:at + 3]


def cases() -> list[dict[str, Any]]:
    """Every tool-call case: id, parser, text, expect (and the tool set, `meant` where needed)."""
    out: list[dict[str, Any]] = []
    for parser, render in RENDER.items():
        def add(kind: str, text: str, expect: str = "agree", meant: Any = None, tools: str = "base") -> None:
            out.append({"id": f"{parser}/{kind}", "parser": parser, "text": text, "expect": expect, "meant": meant,
                        "tools": tools})

        add("one", render(ONE))
        add("lead", _lead(parser, render(ONE)))
        if parser != "gpt-oss":
            add("two", render(TWO))
            add("lead_two", f"{LEAD}\n\n" + render(TWO) if parser != "llama3" else f"{LEAD}<|python_tag|>" + render(TWO))
            # the space before the call is the content's (SGLang's llama3, kimi_k2, minimax and
            # qwen3_coder keep it; the others strip the content)
            add("lead_space", f"{LEAD} " + (render(ONE) if parser != "llama3" else "<|python_tag|>" + render(ONE)))
        add("unicode", render(UNICODE))
        add("nested", render(NESTED))
        add("answer", "The answer is 42.\n", "agree/no_call")
        if STOP[parser]:
            # llama3, mistral: SGLang leaves the stop token in the text (llama3's without its first
            # character); the engine's content leaves it out. The calls agree.
            add("stop_kept", render(ONE) + STOP[parser], "agree/stop_in_sglang_text" if parser in ("llama3", "mistral") else "agree")
        text, sglang = MALFORMED[parser]
        add("malformed", text, f"engine_error/{sglang}", [["code_interpreter", {"code": "print(1)"}]])
        add("cut", _cut(render(ONE)), f"engine_error/{CUT_SGLANG.get(parser, 'no_call')}", [list(c) for c in ONE])
        add("unknown_tool", render([("web_search", {"query": "x"})]), "unknown_tool")
        if parser in TYPED:
            add("bad_integer", render([("lookup", {"city": "Oslo", "days": "soon"})]), "engine_error/string_kept")
            # a root oneOf of objects: `kind` picks the branch that types `size`; SGLang's detectors but
            # GLM-4.7's type it by the first branch, whatever `kind` says
            add("union_circle", render([("shapes", {"kind": "circle", "size": 7})]), tools="typed")
            add("union_label", render([("shapes", {"kind": "label", "size": "7"})]),
                "agree" if parser == "glm47" else "engine_fits/sglang_breaks_schema", tools="typed")
        for kind, text, expect in SHAPES.get(parser, ()):
            add(kind, text, expect, [list(c) for c in ONE])
    return out


_PY_TAG = "<|python_tag|>"
_HERMES_ARRAY = ('<tool_call>\n[{"name": "code_interpreter", "arguments": {"code": "print(6*7)"}}, '
                 '{"name": "lookup", "arguments": {"city": "Paris", "days": 3}}]\n</tool_call>')
_KIMI = "<|tool_calls_section_begin|><|tool_call_begin|>{id}<|tool_call_argument_begin|>{args}<|tool_call_end|><|tool_calls_section_end|>"
_HARMONY_CALL = '<|constrain|>json<|message|>{"code": "print(6*7)"}<|call|>'
# Shapes from SGLang's detector tests, per parser: (kind, text, expect).
SHAPES: dict[str, list[tuple[str, str, str]]] = {
    "hermes": [("array", _HERMES_ARRAY, "agree"), ("array_lead", f"{LEAD}\n{_HERMES_ARRAY}", "agree"),
               ("no_newline", '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(6*7)"}}</tool_call>', "agree")],
    "qwen25": [("array", _HERMES_ARRAY, "agree"),
               # qwen25 needs "<tool_call>\n"; without it SGLang sees no call, the engine reads the same family's call
               ("no_newline", '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(6*7)"}}</tool_call>', "engine_reads")],
    "llama3": [
        # each call after its own <|python_tag|>: SGLang reads both (the engine used to leave the second in the text)
        ("two_tags", _PY_TAG + llama3(ONE) + _PY_TAG + llama3([TWO[1]]), "agree"),
        ("two_tags_lead", LEAD + " " + _PY_TAG + llama3(ONE) + _PY_TAG + llama3([TWO[1]]), "agree"),
        ("semicolon_space", _PY_TAG + llama3(ONE) + "; " + llama3([TWO[1]]), "agree"),
        ("arguments_key", _PY_TAG + '{"name": "code_interpreter", "arguments": {"code": "print(6*7)"}}', "agree"),
        ("python_dict", _PY_TAG + "{'name': 'code_interpreter', 'parameters': {'code': 'print(6*7)'}}", "agree"),
        ("text_after", _PY_TAG + llama3(ONE) + " Done.", "agree"),
        ("json_answer", '{"answer": 42}', "text"),
        # Llama 3.1 also ends a call with <|eom_id|>; Meta's built-in code interpreter writes bare code
        # after <|python_tag|>, which neither reads as a call
        ("eom_kept", llama3(ONE) + "<|eom_id|>", "agree/stop_in_sglang_text"),
        ("builtin_code", "<|python_tag|>print(6*7)<|eom_id|>", "text"),
    ],
    "kimi_k2": [
        # a bare counter for an id: SGLang infers the tool from the arguments' keys
        ("bare_counter", _KIMI.format(id="0", args='{"city": "Paris", "days": 3}'), "agree"),
        ("bare_counter_code", _KIMI.format(id="3", args='{"code": "print(6*7)"}'), "agree"),
        ("name_no_prefix", _KIMI.format(id="lookup:1", args='{"city": "Paris"}'), "agree"),
        ("bare_counter_no_tool", _KIMI.format(id="0", args='{"query": "x", "top": 3}'), "engine_error/no_call"),
    ],
    "minimax-m2": [
        ("two_blocks", minimax_m2(ONE) + "\n" + minimax_m2([TWO[1]]), "agree"),
        ("text_between", minimax_m2(ONE) + "\nand then\n" + minimax_m2([TWO[1]]), "agree"),
    ],
    "glm45": [
        # a literal backslash-n where the format puts newlines, as a model may write it
        ("escaped_newlines", "<tool_call>code_interpreter\\n<arg_key>code</arg_key>\\n<arg_value>print(6*7)</arg_value>\\n</tool_call>",
         "agree"),
        ("quoted_string", '<tool_call>lookup\n<arg_key>city</arg_key>\n<arg_value>"Paris"</arg_value>\n</tool_call>', "agree"),
        ("escaped_json", '<tool_call>lookup\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n<arg_key>options</arg_key>\n'
                         '<arg_value>{\\"units\\": \\"metric\\"}</arg_value>\n</tool_call>', "agree"),
        ("no_arguments", "<tool_call>code_interpreter\n</tool_call>", "agree"),
    ],
    "glm47": [
        ("quoted_string", '<tool_call>lookup<arg_key>city</arg_key><arg_value>"Paris"</arg_value></tool_call>', "agree"),
        ("escaped_json", '<tool_call>lookup<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>options</arg_key>'
                         '<arg_value>{\\"units\\": \\"metric\\"}</arg_value></tool_call>', "agree"),
        ("no_arguments", "<tool_call>code_interpreter</tool_call>", "agree"),
        ("text_between", glm47(ONE) + "and" + glm47([TWO[1]]), "agree"),
    ],
    "qwen3_coder": [
        # a </parameter> left out before the next tag: unambiguous, read by both
        ("unclosed_parameter", qwen3_coder(TWO).replace("\n</parameter>\n<parameter=days>", "\n<parameter=days>"), "agree"),
        ("two_in_one_block", "<tool_call>\n" + qwen3_coder(ONE)[len("<tool_call>\n"):-len("\n</tool_call>")] + "\n"
         + qwen3_coder([TWO[1]])[len("<tool_call>\n"):], "agree"),
    ],
    "mistral": [("compact", "[TOOL_CALLS]code_interpreter[ARGS]{\"code\": \"print(6*7)\"}", "agree"),
                ("compact_two", "[TOOL_CALLS]code_interpreter[ARGS]{\"code\": \"print(6*7)\"}[TOOL_CALLS]lookup[ARGS]{\"city\": \"Paris\"}",
                 "agree")],
    "gpt-oss": [
        # harmony allows a call as the turn's first message, and the recipient before the channel;
        # SGLang's detector misses both
        ("first_message", f"<|channel|>commentary to=functions.code_interpreter {_HARMONY_CALL}", "engine_reads"),
        ("recipient_first", f"<|channel|>analysis<|message|>Use it.<|end|><|start|>assistant to=functions.code_interpreter"
                            f"<|channel|>commentary {_HARMONY_CALL}", "engine_reads"),
        # a function call on the analysis channel is not one (harmony calls functions on commentary)
        ("analysis_call", f"<|channel|>analysis to=functions.code_interpreter {_HARMONY_CALL}", "text"),
    ],
}


def typed_cases() -> list[dict[str, Any]]:
    """One call to `typed` per family, argument schema and written value: id, parser, text, argument, raw."""
    out = []
    for parser in TYPED:
        for argument in TYPED_SCHEMAS:
            for i, raw in enumerate(TYPED_VALUES):
                text = _typed_text(parser, argument, raw)
                out.append({"id": f"{parser}/{argument}/{i}", "parser": parser, "text": text, "argument": argument, "raw": raw,
                            "tools": "typed"})
    return out


def _typed_text(parser: str, key: str, raw: str) -> str:
    if parser == "qwen3_coder":
        return f"<tool_call>\n<function=typed>\n<parameter={key}>\n{raw}\n</parameter>\n</function>\n</tool_call>"
    if parser == "glm45":
        return f"<tool_call>typed\n<arg_key>{key}</arg_key>\n<arg_value>{raw}</arg_value>\n</tool_call>"
    if parser == "glm47":
        return f"<tool_call>typed<arg_key>{key}</arg_key><arg_value>{raw}</arg_value></tool_call>"
    return f'<minimax:tool_call>\n<invoke name="typed">\n<parameter name="{key}">{raw}</parameter>\n</invoke>\n</minimax:tool_call>'


# Reasoning formats as SGLang serves them: (reasoning parser, tool-call parser, whether the prompt
# opened the reasoning, how the turn closes its reasoning). The shapes of SGLang's reasoning tests.
FAMILIES_THINKING = [
    ("qwen3", "qwen25", False, "<think>{r}</think>\n\n"),  # Qwen3: the model opens <think>
    ("qwen3", "qwen3_coder", True, "{r}\n</think>\n\n"),  # Qwen3.5: the prompt opens it
    ("qwen3-thinking", "qwen25", False, "{r}</think>\n\n"),
    ("glm45", "glm45", False, "<think>{r}</think>\n"),  # GLM-4.5
    ("glm45", "glm47", True, "{r}</think>"),  # GLM-4.7: the prompt opens it
    ("deepseek-v3", "deepseekv31", True, "{r}</think>"),  # DeepSeek-V3.1 with thinking
    ("deepseek-v3", "deepseekv31", False, ""),  # ...without: the prompt closed it
    ("deepseek-r1", "deepseekv3", False, "{r}</think>\n\n"),  # R1 always reasons
    ("kimi_k2", "kimi_k2", False, "<think>{r}</think>"),
    ("minimax", "minimax-m2", False, "{r}\n</think>\n\n"),
    ("mistral", "mistral", False, "[THINK]{r}[/THINK]"),
    ("kimi", "hermes", False, "◁think▷{r}◁/think▷"),
    ("nemotron_3", "hermes", False, "<think>{r}</think>"),
    ("gemma4", "hermes", False, "<|channel>thought\n{r}<channel|>"),
    ("deepseek-v4", "hermes", False, "<think>{r}</think>"),
]
THOUGHT = "The user wants 6*7; the tool computes it."
OPEN = {"mistral": "[THINK]", "kimi": "◁think▷", "gemma4": "<|channel>thought\n"}


def reasoning_cases() -> list[dict[str, Any]]:
    """Every served case: id, reasoning, parser, forced, text, expect."""
    out: list[dict[str, Any]] = []
    for reasoning, parser, forced, close in FAMILIES_THINKING:
        render = RENDER[parser]
        opened = close.split("{r}")[0] if "{r}" in close else ""
        end = close.split("{r}")[1] if "{r}" in close else ""
        family = f"{reasoning}+{parser}{'+forced' if forced else ''}"

        def add(kind: str, text: str, expect: str = "agree") -> None:
            out.append({"id": f"{family}/{kind}", "reasoning": reasoning, "parser": parser, "forced": forced, "text": text,
                        "expect": expect})

        call = render(ONE)
        add("call_after", close.format(r=THOUGHT) + LEAD + "\n" + call)
        add("answer_after", close.format(r=THOUGHT) + "The answer is 42.")
        if not end:  # no reasoning in this mode: the turn is content and calls
            add("call_only", call)
            continue
        add("call_inside", close.format(r=f"{THOUGHT} Maybe {call} or not.") + "No tool needed: 42.")
        add("call_inside_cut", opened + f"{THOUGHT} Maybe {call} then")  # reasoning cut before its end
        add("unclosed_then_call", opened + THOUGHT + "\n" + call)  # a call where the end tag should be
        add("cut", opened + THOUGHT)
        add("two_ends", close.format(r="first") + "second" + end + call)  # the first end tag ends it
        add("reopened", OPEN.get(reasoning, "<think>") + close.format(r=THOUGHT) + call)  # the tag written again
        add("no_reasoning", LEAD + "\n" + call)
        add("mid_text_open", "Hmm. " + close.format(r=THOUGHT).lstrip() + call if opened else LEAD + end + call)
    # gpt-oss reasons in harmony's analysis channel
    harmony = "<|channel|>analysis<|message|>{r}<|end|><|start|>assistant"
    for kind, text, expect in [
        ("call_after", harmony.format(r=THOUGHT) + "<|channel|>commentary to=functions.code_interpreter " + _HARMONY_CALL, "agree"),
        ("preamble", harmony.format(r=THOUGHT) + "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant"
                     "<|channel|>commentary to=functions.code_interpreter " + _HARMONY_CALL, "agree"),
        ("final", harmony.format(r=THOUGHT) + "<|channel|>final<|message|>The answer is 42.<|return|>", "agree"),
        ("two_analysis", harmony.format(r="one") + harmony.format(r="two") + "<|channel|>final<|message|>42<|return|>", "agree"),
        ("cut", "<|channel|>analysis<|message|>" + THOUGHT, "agree"),
        ("call_on_analysis", f"<|channel|>analysis to=functions.code_interpreter {_HARMONY_CALL}", "no_call"),
        # text outside any message: SGLang's harmony reader drops it, the engine keeps it as content
        ("plain_text", "The answer is 42.", "content_dropped_by_sglang"),
    ]:
        out.append({"id": f"gpt-oss/{kind}", "reasoning": "gpt-oss", "parser": "gpt-oss", "forced": False, "text": text, "expect": expect})
    return out


# Reasoning parsers the engine reads through SGLang's own (not natively): a turn each.
BRIDGED_REASONING = {  # name: (turn, its reasoning, the rest, the opening tag)
    "ling3": ("<think>" + THOUGHT + "</think>The answer is 42.", THOUGHT, "The answer is 42.", "<think>"),
    "minimax-m3": ("<mm:think>" + THOUGHT + "</mm:think>The answer is 42.", THOUGHT, "The answer is 42.", "<mm:think>"),
}


# Names the engine reads through SGLang's own detector (not natively): one call each, from the
# reference notes. The oracle runs them through the engine's bridge inside the SGLang venv.
BRIDGED = {
    "step3": "<｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name=\"code_interpreter\">"
             "<steptml:parameter name=\"code\">print(6*7)</steptml:parameter></steptml:invoke><｜tool_call_end｜><｜tool_calls_end｜>",
    "gemma4": "<|tool_call>call:code_interpreter{code:<|\"|>print(6*7)<|\"|>}<tool_call|>",
    "deepseekv32": "\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"code_interpreter\">\n<｜DSML｜parameter name=\"code\" "
                   "string=\"true\">print(6*7)</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>",
}
