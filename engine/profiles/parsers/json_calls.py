"""Families whose calls carry JSON arguments: hermes/qwen25, llama3, mistral, deepseekv3/v31, kimi_k2.

Every parser here is stricter than SGLang's detector where that one loses a call silently
(broken JSON, an unclosed block): the call becomes a `malformed_call` for the model to read.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from engine.profiles.base import ToolCall
from engine.profiles.parsers.base import (
    ParsedTurn, Schemas, call_from_json_text, calls_from_json_text, json_call, malformed, properties_of, split_blocks,
)


class HermesParser:
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, blocks joined by newlines; a block
    may hold a JSON array of such calls.

    Hermes-2-Pro/3, Qwen2.5, Qwen3, QwQ (SGLang: hermes, qwen25, qwen).
    """

    def __init__(self, name: str = "hermes") -> None:
        self.name = name

    def parse(self, text: str, schemas: Schemas) -> ParsedTurn:
        _, bodies, open_last = split_blocks(text, "<tool_call>", "</tool_call>")
        if not bodies:
            return ParsedTurn(text)
        calls: list[ToolCall] = []
        for body in bodies[: len(bodies) - open_last]:
            calls += calls_from_json_text(body.strip(), "the tool call")
        if open_last:
            calls.append(malformed("<tool_call> is not closed by </tool_call>"))
        return ParsedTurn(text.split("<tool_call>", 1)[0].strip(), tuple(calls))


class Llama3Parser:
    """Llama 3.1-3.3 JSON tools: `{"name": ..., "parameters": {...}}` after `<|python_tag|>` or as the
    whole turn, several joined by `;` (or each after its own `<|python_tag|>`). A turn that is not
    JSON (nor after `<|python_tag|>`) is text; so is a JSON object that names no function."""

    name = "llama3"
    # Meta's ChatFormat ends a call turn with <|eom_id|> where the model awaits a result
    # ("Environment: ipython"), with <|eot_id|> otherwise; both are in Llama 3.1's stop ids.
    turn_ends = ("<|eom_id|>",)
    _ENDS = ("<|eot_id|>", "<|eom_id|>")
    _TAG = "<|python_tag|>"

    def parse(self, text: str, schemas: Schemas) -> ParsedTurn:
        body = text
        for end in self._ENDS:
            body = body.replace(end, "")
        if self._TAG in body:
            content, action = body.split(self._TAG, 1)
        elif body.startswith("{"):
            content, action = "", body
        else:
            return ParsedTurn(text)
        if not action.lstrip().startswith("{"):  # built-in tool code (ipython), not a JSON call: text
            return ParsedTurn(text)
        calls: list[ToolCall] = []
        pos = 0
        while pos < len(action):
            found = _json_object(action, pos)
            if found is None:
                calls.append(malformed("the tool call is not valid JSON"))
                pos = len(action)
                break
            data, end = found
            if not isinstance(data, dict) or not isinstance(data.get("name"), str):
                if not calls and self._TAG not in body:
                    return ParsedTurn(text)  # a JSON answer, not a call
                calls.append(malformed('a tool call must be {"name": ..., "parameters": {...}}'))
            else:
                calls.append(json_call(data["name"], data["parameters"] if "parameters" in data else data.get("arguments", {})))
            pos = end
            while action.startswith(self._TAG, pos) or pos < len(action) and action[pos] in "; \n\t":
                pos += len(self._TAG) if action.startswith(self._TAG, pos) else 1
            if pos < len(action) and action[pos] != "{":
                break
        return ParsedTurn(content + action[pos:].strip(), tuple(calls))


def _json_object(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value at `pos` (or a Python dict literal there, as a model may write one), and where it ends."""
    try:
        return json.JSONDecoder().raw_decode(text, pos)
    except ValueError:
        pass
    depth = 0
    for i in range(pos, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            try:
                value = ast.literal_eval(text[pos:i + 1])
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                return None
            return (value, i + 1) if isinstance(value, dict) else None
    return None


class MistralParser:
    """`[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": ...}, ...]` (v2-v7) or
    `[TOOL_CALLS]name[ARGS]{...}` / `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}` per call (v11, v13)."""

    name = "mistral"
    _MARK = "[TOOL_CALLS]"
    _COMPACT = re.compile(r"\s*([^\[\]\s]+)(?:\[CALL_ID\]([^\[]*))?\[ARGS\]")

    def parse(self, text: str, schemas: Schemas) -> ParsedTurn:
        at = text.find(self._MARK)
        if at < 0:
            return ParsedTurn(text)
        content, rest = text[:at], text[at:]
        calls: list[ToolCall] = []
        decoder = json.JSONDecoder()
        trailing = ""
        while rest.startswith(self._MARK):
            rest = rest[len(self._MARK):]
            stripped = rest.lstrip()
            if stripped.startswith("["):
                try:
                    data, end = decoder.raw_decode(stripped)
                except ValueError as exc:
                    calls.append(malformed(f"the [TOOL_CALLS] array is not valid JSON: {exc}"))
                    break
                items = data if isinstance(data, list) else [data]
                for item in items:
                    if isinstance(item, dict) and isinstance(item.get("name"), str):
                        calls.append(json_call(item["name"], item.get("arguments", item.get("parameters", {})), item.get("id")))
                    else:
                        calls.append(malformed('each tool call must be {"name": ..., "arguments": {...}}'))
                rest = stripped[end:].lstrip()
            else:
                match = self._COMPACT.match(rest)
                if match is None:
                    calls.append(malformed("[TOOL_CALLS] is not followed by a call ([{...}] or name[ARGS]{...})"))
                    break
                args = rest[match.end():].lstrip()
                try:
                    data, end = decoder.raw_decode(args)
                except ValueError as exc:
                    calls.append(malformed(f"the arguments of {match.group(1)} are not valid JSON: {exc}", match.group(1)))
                    break
                calls.append(json_call(match.group(1), data, (match.group(2) or "").strip()))
                rest = args[end:].lstrip()
            trailing = rest if not rest.startswith(self._MARK) else ""
        for end_token in ("</s>",):
            trailing = trailing.replace(end_token, "")
        return ParsedTurn((content.strip() + " " + trailing.strip()).strip(), tuple(calls))


class SectionParser:
    """A section of special-token-delimited calls (DeepSeek, Kimi K2): the text before the section
    is the content (stripped where the family's detector strips it), each closed call block is
    read by `_call`, an unclosed block or section is one malformed call. Without a section the
    turn is text."""

    BEGIN: str
    END: str
    CALL: str
    CALL_END: str
    STRIP_CONTENT = True

    def parse(self, text: str, schemas: Schemas) -> ParsedTurn:
        at = text.find(self.BEGIN)
        if at < 0:
            return ParsedTurn(text)
        content, section = text[:at], text[at + len(self.BEGIN):]
        closed = self.END in section
        section = section.split(self.END, 1)[0]
        _, bodies, open_last = split_blocks(section, self.CALL, self.CALL_END)
        calls = [self._call(b, schemas) for b in bodies[: len(bodies) - open_last]]
        if open_last or not closed:
            calls.append(malformed(f"{self.CALL} / {self.BEGIN} is not closed"))
        return ParsedTurn(content.strip() if self.STRIP_CONTENT else content, tuple(calls))

    def _call(self, body: str, schemas: Schemas) -> ToolCall:
        raise NotImplementedError


class DeepSeekParser(SectionParser):
    """DeepSeek V3/R1 (`v31=False`): `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`;
    V3.1 (`v31=True`): `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`; inside
    `<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>`."""

    BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    _V3_BODY = re.compile(r"(.*?)<｜tool▁sep｜>(.*?)\n```json\n(.*)\n```\s*$", re.DOTALL)

    def __init__(self, name: str, *, v31: bool) -> None:
        self.name = name
        self.v31 = v31

    def _call(self, body: str, schemas: Schemas) -> ToolCall:
        if self.v31:
            name, sep, args = body.partition(self.SEP)
            if not sep:
                return malformed(f"a tool call needs NAME{self.SEP}{{arguments}}")
            return call_from_json_text(args, f"the arguments of {name}", name.strip())
        match = self._V3_BODY.match(body)
        if match is None:
            return malformed(f"a tool call must be function{self.SEP}NAME\\n```json\\n{{...}}\\n```")
        return call_from_json_text(match.group(3), f"the arguments of {match.group(2)}", match.group(2).strip())


class KimiK2Parser(SectionParser):
    """Kimi K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>`.

    A call may carry a bare counter (`0`) for its id; its tool is then the only one offered, or the
    one whose parameters its arguments name best, as SGLang's detector infers it.
    """

    name = "kimi_k2"
    BEGIN, END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    CALL, CALL_END, ARGS = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
    STRIP_CONTENT = False
    _ID = re.compile(r"^(?:functions\.)?([\w.\-]+):\d+$")
    _COUNTER = re.compile(r"^\d+$")

    def _call(self, body: str, schemas: Schemas) -> ToolCall:
        ident, sep, args = body.partition(self.ARGS)
        ident, args = ident.strip(), args.strip()
        match = self._ID.match(ident)
        if not sep or match is None and not self._COUNTER.match(ident):
            return malformed(f"a tool call must be functions.NAME:N{self.ARGS}{{arguments}}")
        name = match.group(1) if match else _tool_for(args, schemas)
        if name is None:
            return malformed(f"the call {ident} names no function, and its arguments fit no one tool: write functions.NAME:{ident}")
        return call_from_json_text(args, f"the arguments of {name}", name, ident)


def _tool_for(arguments: str, schemas: Schemas) -> str | None:
    """The tool a call without a name means: the only one, else the one whose parameters best cover
    the arguments' keys (each key it lacks counts against it; the first such tool on a tie)."""
    if len(schemas) == 1:
        return next(iter(schemas))
    try:
        data = json.loads(arguments)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    keys = set(data)
    best, score = None, -1  # a tool that covers none of them more than it lacks is no match
    for tool in schemas:
        declared = set(properties_of(schemas, tool))
        if declared and len(keys & declared) - len(keys - declared) > score:
            best, score = tool, len(keys & declared) - len(keys - declared)
    return best
