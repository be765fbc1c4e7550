"""Families whose calls carry JSON arguments: hermes/qwen25, llama3, mistral, deepseekv3/v31, kimi_k2.

Every parser here is stricter than SGLang's detector where that one loses a call silently
(broken JSON, an unclosed block): the call becomes a `malformed_call` for the model to read.
"""

from __future__ import annotations

import json
import re
from engine.profiles.base import ToolCall
from engine.profiles.parsers.base import ParsedTurn, Schemas, call_from_json_text, json_call, malformed, split_blocks


class HermesParser:
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, blocks joined by newlines.

    Hermes-2-Pro/3, Qwen2.5, Qwen3, QwQ (SGLang: hermes, qwen25, qwen).
    """

    reasoning = True

    def __init__(self, name: str = "hermes") -> None:
        self.name = name

    def parse(self, text: str, schemas: Schemas) -> ParsedTurn:
        content, bodies, open_last = split_blocks(text, "<tool_call>", "</tool_call>")
        calls = [call_from_json_text(b.strip(), "the tool call") for b in bodies[: len(bodies) - open_last]]
        if open_last:
            calls.append(malformed("<tool_call> is not closed by </tool_call>"))
        return ParsedTurn((text.split("<tool_call>", 1)[0] if bodies else content).strip(), tuple(calls))


class Llama3Parser:
    """Llama 3.1-3.3 JSON tools: `{"name": ..., "parameters": {...}}` (maybe after `<|python_tag|>`),
    several joined by `;`. A turn that is not JSON (nor after `<|python_tag|>`) is text."""

    name = "llama3"
    reasoning = True
    # Meta's ChatFormat ends a call turn with <|eom_id|> where the model awaits a result
    # ("Environment: ipython"), with <|eot_id|> otherwise; both are in Llama 3.1's stop ids.
    turn_ends = ("<|eom_id|>",)
    _ENDS = ("<|eot_id|>", "<|eom_id|>")

    def parse(self, text: str, schemas: Schemas) -> ParsedTurn:
        body = text
        for end in self._ENDS:
            body = body.replace(end, "")
        if "<|python_tag|>" in body:
            content, action = body.split("<|python_tag|>", 1)
        elif body.lstrip().startswith("{"):
            content, action = "", body
        else:
            return ParsedTurn(text.strip())
        action = action.strip()
        if not action.startswith("{"):  # built-in tool code (ipython), not a JSON call: text
            return ParsedTurn(text.strip())
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        pos = 0
        while pos < len(action):
            try:
                data, end = decoder.raw_decode(action, pos)
            except ValueError as exc:
                calls.append(malformed(f"the tool call is not valid JSON: {exc}"))
                break
            if not isinstance(data, dict) or not isinstance(data.get("name"), str):
                if not calls and "<|python_tag|>" not in body:
                    return ParsedTurn(text.strip())  # a JSON answer, not a call
                calls.append(malformed('a tool call must be {"name": ..., "parameters": {...}}'))
                break
            calls.append(json_call(data["name"], data["parameters"] if "parameters" in data else data.get("arguments", {})))
            pos = end
            while pos < len(action) and action[pos] in "; \n\t":
                pos += 1
            if pos < len(action) and action[pos] != "{":
                content = (content + " " + action[pos:]).strip()
                break
        return ParsedTurn(content.strip(), tuple(calls))


class MistralParser:
    """`[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": ...}, ...]` (v2-v7) or
    `[TOOL_CALLS]name[ARGS]{...}` / `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}` per call (v11, v13)."""

    name = "mistral"
    reasoning = True
    _MARK = "[TOOL_CALLS]"
    _COMPACT = re.compile(r"\s*([^\[\]\s]+)(?:\[CALL_ID\]([^\[]*))?\[ARGS\]")

    def parse(self, text: str, schemas: Schemas) -> ParsedTurn:
        at = text.find(self._MARK)
        if at < 0:
            return ParsedTurn(text.strip())
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
    is the content, each closed call block is read by `_call`, an unclosed block or section is one
    malformed call. Without a section the turn is text, its end-of-turn token (`STOP`) dropped."""

    BEGIN: str
    END: str
    CALL: str
    CALL_END: str
    STOP: str

    def parse(self, text: str, schemas: Schemas) -> ParsedTurn:
        at = text.find(self.BEGIN)
        if at < 0:
            return ParsedTurn(text.replace(self.STOP, "").strip())
        content, section = text[:at], text[at + len(self.BEGIN):]
        closed = self.END in section
        section = section.split(self.END, 1)[0]
        _, bodies, open_last = split_blocks(section, self.CALL, self.CALL_END)
        calls = [self._call(b) for b in bodies[: len(bodies) - open_last]]
        if open_last or not closed:
            calls.append(malformed(f"{self.CALL} / {self.BEGIN} is not closed"))
        return ParsedTurn(content.strip(), tuple(calls))

    def _call(self, body: str) -> ToolCall:
        raise NotImplementedError


class DeepSeekParser(SectionParser):
    """DeepSeek V3/R1 (`v31=False`): `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`;
    V3.1 (`v31=True`): `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`; inside
    `<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>`."""

    reasoning = True
    BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    STOP = "<｜end▁of▁sentence｜>"
    _V3_BODY = re.compile(r"(.*?)<｜tool▁sep｜>(.*?)\n```json\n(.*)\n```\s*$", re.DOTALL)

    def __init__(self, name: str, *, v31: bool) -> None:
        self.name = name
        self.v31 = v31

    def _call(self, body: str) -> ToolCall:
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
    """Kimi K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>`."""

    name = "kimi_k2"
    reasoning = True
    BEGIN, END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    CALL, CALL_END, ARGS = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
    STOP = "<|im_end|>"
    _ID = re.compile(r"^(?:functions\.)?([\w.\-]+):\d+$")

    def _call(self, body: str) -> ToolCall:
        ident, sep, args = body.partition(self.ARGS)
        match = self._ID.match(ident.strip())
        if not sep or match is None:
            return malformed(f"a tool call must be functions.NAME:N{self.ARGS}{{arguments}}")
        return call_from_json_text(args.strip(), f"the arguments of {match.group(1)}", match.group(1), ident.strip())
