"""`pythonic` (Llama 4, Llama 3.2 1B/3B): `[name(key="value", n=1), other(...)]`, Python literals."""

from __future__ import annotations

import ast
import re
from typing import Any

from engine.profiles.base import ToolCall
from engine.profiles.parsers.base import ParsedTurn, Schemas, malformed

_START = re.compile(r"\[\s*[A-Za-z_]\w*\(")


class PythonicParser:
    """A Python list of keyword-argument calls anywhere in the turn; text around it is content."""

    name = "pythonic"

    def parse(self, text: str, schemas: Schemas) -> ParsedTurn:
        raw = text
        text = text.strip().replace("<|python_start|>", "").replace("<|python_end|>", "")
        start = _START.search(text)
        if start is None:
            return ParsedTurn(raw)
        s = start.start()
        for e in (m.end() for m in re.finditer(r"\]", text[s:])):
            try:
                tree = ast.parse(text[s:s + e].strip(), mode="eval").body
            except (SyntaxError, ValueError):
                continue
            if isinstance(tree, ast.List) and tree.elts and all(isinstance(c, ast.Call) for c in tree.elts):
                calls = tuple(_call(c) for c in tree.elts)
                return ParsedTurn(text[:s] + text[s + e:], calls)
        return ParsedTurn(text[:s], (malformed("the call list [name(key=value, ...)] is not valid Python"),))


def _call(node: ast.Call) -> ToolCall:
    if not isinstance(node.func, ast.Name):
        return malformed("a call must name a function: name(key=value, ...)")
    name = node.func.id
    if node.args or any(k.arg is None for k in node.keywords):
        return malformed(f"{name}: arguments must be given by keyword (key=value)", name)
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)  # type: ignore[index]
        except (ValueError, SyntaxError, TypeError):
            return malformed(f"{name}: argument {keyword.arg!r} is not a literal", name)
    return ToolCall(name, arguments)
