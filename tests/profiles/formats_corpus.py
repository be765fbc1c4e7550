"""Model turns in every native tool-call format, for the differential test against SGLang's detectors.

Imports nothing of the engine: `sglang_oracle.py` reads this module inside a scratch venv
holding SGLang. Each case: the parser name, the turn text, and what is expected:
- "agree": the engine's calls (names, typed arguments) and text equal SGLang's;
- "agree/stop_in_sglang_text": the calls agree; SGLang's text holds the turn's stop token, the engine's is empty;
- "engine_error/no_call": the engine answers an error observation where SGLang finds no call
  (the call would be lost, the turn taken as text);
- "engine_error/damaged_call": the engine answers an error where SGLang returns a damaged call
  (a truncated value, `{}` for a missing tag, arguments that are not JSON);
- "engine_error/string_kept": the value does not fit the schema; SGLang passes it on as a string,
  the engine names the argument in an error;
- "unknown_tool": the engine reports the call (the loop answers `unknown_tool`); SGLang drops it
  or passes it, by detector.
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
    """Every case: id, parser, text, expect."""
    out: list[dict[str, Any]] = []
    for parser, render in RENDER.items():
        def add(kind: str, text: str, expect: str = "agree", meant: Any = None) -> None:
            out.append({"id": f"{parser}/{kind}", "parser": parser, "text": text, "expect": expect, "meant": meant})

        add("one", render(ONE))
        add("lead", _lead(parser, render(ONE)))
        if parser != "gpt-oss":
            add("two", render(TWO))
            add("lead_two", f"{LEAD}\n\n" + render(TWO) if parser != "llama3" else f"{LEAD}<|python_tag|>" + render(TWO))
        add("unicode", render(UNICODE))
        add("nested", render(NESTED))
        if STOP[parser]:
            # llama3, mistral: SGLang leaves the stop token in the text (llama3's without its first
            # character); the engine's content leaves it out. The calls agree.
            add("stop_kept", render(ONE) + STOP[parser], "agree/stop_in_sglang_text" if parser in ("llama3", "mistral") else "agree")
        text, sglang = MALFORMED[parser]
        add("malformed", text, f"engine_error/{sglang}", [["code_interpreter", {"code": "print(1)"}]])
        add("cut", _cut(render(ONE)), f"engine_error/{CUT_SGLANG.get(parser, 'no_call')}", [list(c) for c in ONE])
        if parser == "llama3":
            # Llama 3.1 also ends a call with <|eom_id|>; Meta's built-in code interpreter writes bare code
            # after <|python_tag|>, which neither reads as a call
            add("eom_kept", render(ONE) + "<|eom_id|>", "agree/stop_in_sglang_text")
            add("builtin_code", "<|python_tag|>print(6*7)<|eom_id|>", "text")
        if parser == "qwen3_coder":  # a </parameter> left out before the next tag: unambiguous, read by both
            add("unclosed_parameter", render(TWO).replace("\n</parameter>\n<parameter=days>", "\n<parameter=days>"))
        add("unknown_tool", render([("web_search", {"query": "x"})]), "unknown_tool")
        if parser in TYPED:
            add("bad_integer", render([("lookup", {"city": "Oslo", "days": "soon"})]), "engine_error/string_kept")
    return out


# Names the engine reads through SGLang's own detector (not natively): one call each, from the
# reference notes. The oracle runs them through the engine's bridge inside the SGLang venv.
BRIDGED = {
    "step3": "<｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name=\"code_interpreter\">"
             "<steptml:parameter name=\"code\">print(6*7)</steptml:parameter></steptml:invoke><｜tool_call_end｜><｜tool_calls_end｜>",
    "gemma4": "<|tool_call>call:code_interpreter{code:<|\"|>print(6*7)<|\"|>}<tool_call|>",
    "deepseekv32": "\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"code_interpreter\">\n<｜DSML｜parameter name=\"code\" "
                   "string=\"true\">print(6*7)</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>",
}
