"""Families that write each argument as text between tags, typed by the tool's schema:
qwen3_coder, glm45 / glm47, minimax-m2.

SGLang reads these leniently: a call cut mid-value comes back truncated, a missing closing
tag as `{}` arguments. Here every tag must be closed; a call that is not is `malformed_call`.
"""

from __future__ import annotations

import re

from engine.profiles.base import ToolCall
from engine.profiles.parsers.base import ParsedTurn, Schemas, malformed, split_blocks, typed_call
from engine.profiles.parsers.values import Reading


_SPACE = re.compile(r"(?:\\n|\s)*")  # whitespace, or a newline the model wrote escaped (a literal backslash-n)


_EDGES = re.compile(r"^(?:\\n|\s)+|(?:\\n|\s)+$")


def _only_space(text: str) -> bool:
    return _SPACE.fullmatch(text) is not None


class Qwen3CoderParser:
    """`<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`
    (Qwen3-Coder, Qwen3.5/3.6; SGLang also names it step3p5, nanbeige)."""

    values = Reading(string_unions=True)
    _FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)</function>", re.DOTALL)
    # A value ends at its </parameter>, or (the model left that out) where the next parameter or
    # the function's end begins: unambiguous, and read so by SGLang too.
    _PARAM = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)

    def __init__(self, name: str = "qwen3_coder") -> None:
        self.name = name

    def parse(self, text: str, schemas: Schemas) -> ParsedTurn:
        content, bodies, open_last = split_blocks(text, "<tool_call>", "</tool_call>")
        calls: list[ToolCall] = []
        for body in bodies[: len(bodies) - open_last]:
            calls += self._calls(body, schemas)
        if open_last:
            calls.append(malformed("<tool_call> is not closed by </tool_call>"))
        return ParsedTurn(text.split("<tool_call>", 1)[0] if bodies else text, tuple(calls))

    def _calls(self, body: str, schemas: Schemas) -> list[ToolCall]:
        found = list(self._FUNCTION.finditer(body))
        gaps = [body[a.end():b.start()] for a, b in zip(found, found[1:])]
        if not found or not _only_space(body[: found[0].start()] + body[found[-1].end():] + "".join(gaps)):
            return [malformed("a <tool_call> must hold <function=NAME>...</function>")]
        calls = []
        for function in found:
            name, inner = function.group(1), function.group(2)
            params = list(self._PARAM.finditer(inner))
            if not _only_space(self._PARAM.sub("", inner)):
                calls.append(malformed(f"{name}: text between the parameters (each is <parameter=NAME>value</parameter>)", name.strip()))
                continue
            pairs = [(p.group(1), _trim_newline(p.group(2))) for p in params]
            calls.append(typed_call(name, pairs, schemas, self.values))
        return calls


def _trim_newline(value: str) -> str:
    """A value without the one newline the format puts on each side of it."""
    if value.startswith("\n"):
        value = value[1:]
    return value[:-1] if value.endswith("\n") else value


class GlmParser:
    """GLM-4.5/4.6 (`glm45`): `<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>`;
    GLM-4.7/5 (`glm47`): the same without the newlines."""

    _PAIR = re.compile(r"<arg_key>(.*?)</arg_key>(?:\\n|\s)*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def __init__(self, name: str) -> None:
        self.name = name
        # GLM-4.7's detector tries a union's typed branches first; 4.5's reads undeclared values as Python literals too
        self.values = Reading(unquote=True, integral_floats=True, typed_first=name == "glm47", string_unions=name != "glm47",
                              undeclared="json" if name == "glm47" else "literal")

    def parse(self, text: str, schemas: Schemas) -> ParsedTurn:
        content, bodies, open_last = split_blocks(text, "<tool_call>", "</tool_call>")
        calls = [self._call(b, schemas) for b in bodies[: len(bodies) - open_last]]
        if open_last:
            calls.append(malformed("<tool_call> is not closed by </tool_call>"))
        if not bodies:
            return ParsedTurn(text)
        if self.name != "glm47":  # GLM-4.5's content is what comes before the calls; 4.7's all text around them
            content = text.split("<tool_call>", 1)[0]
        return ParsedTurn(content.strip(), tuple(calls))

    def _call(self, body: str, schemas: Schemas) -> ToolCall:
        at = body.find("<arg_key>")
        name = _EDGES.sub("", body if at < 0 else body[:at])
        args = "" if at < 0 else body[at:]
        if not re.fullmatch(r"[\w.\-:/]+", name):
            return malformed("a <tool_call> must start with the function name")
        pairs = list(self._PAIR.finditer(args))
        if not _only_space(self._PAIR.sub("", args)):
            return malformed(f"{name}: every <arg_key>K</arg_key> must be followed by <arg_value>V</arg_value>", name)
        return typed_call(name, [(p.group(1), p.group(2)) for p in pairs], schemas, self.values)


class MiniMaxM2Parser:
    """MiniMax M2.x: `<minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="K">V</parameter>\\n</invoke>\\n</minimax:tool_call>`."""

    name = "minimax-m2"
    values = Reading(typed_first=True, loose_booleans=True, null_words=("null", "none", "nil"))
    _INVOKE = re.compile(r'<invoke name="([^"]*)">(.*?)</invoke>', re.DOTALL)
    _PARAM = re.compile(r'<parameter name="([^"]*)">(.*?)</parameter>', re.DOTALL)

    def parse(self, text: str, schemas: Schemas) -> ParsedTurn:
        content, bodies, open_last = split_blocks(text, "<minimax:tool_call>", "</minimax:tool_call>")
        calls: list[ToolCall] = []
        for body in bodies[: len(bodies) - open_last]:
            invokes = list(self._INVOKE.finditer(body))
            if not invokes or not _only_space(self._INVOKE.sub("", body)):
                calls.append(malformed('a <minimax:tool_call> must hold <invoke name="NAME">...</invoke>'))
                continue
            for invoke in invokes:
                name, inner = invoke.group(1), invoke.group(2)
                if not _only_space(self._PARAM.sub("", inner)):
                    calls.append(malformed(f'{name}: every <parameter name="K"> must be closed by </parameter>', name))
                    continue
                pairs = [(p.group(1), p.group(2).strip("\n")) for p in self._PARAM.finditer(inner)]
                calls.append(typed_call(name, pairs, schemas, self.values))
        if open_last:
            calls.append(malformed("<minimax:tool_call> is not closed by </minimax:tool_call>"))
        return ParsedTurn(content if bodies else text, tuple(calls))
