"""`gpt-oss`: OpenAI's harmony messages, after a prompt ending `<|start|>assistant`.

`<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>commentary to=functions.NAME
<|constrain|>json<|message|>{...}<|call|>`. The analysis channel is reasoning (never run, never
content; the `gpt-oss` reasoning parser splits it off first, as SGLang's does): a function
addressed there is no call, as for SGLang, since harmony calls functions on the commentary
channel. A commentary message without a recipient (a preamble) and the final channel are
content. The recipient may also stand before `<|channel|>`, and a call may be the turn's first
message (SGLang's detector misses both).
"""

from __future__ import annotations

import re

from engine.profiles.base import ToolCall
from engine.profiles.parsers.base import ParsedTurn, Schemas, call_from_json_text, malformed

_ENDS = re.compile(r"<\|end\|>|<\|call\|>|<\|return\|>")
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=\s|<\||$)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class HarmonyParser:
    """Reads each message of the turn by its channel and recipient."""

    name = "gpt-oss"

    def parse(self, text: str, schemas: Schemas) -> ParsedTurn:
        content: list[str] = []
        calls: list[ToolCall] = []
        for header, body in _messages(text):
            recipient = _RECIPIENT.search(header)
            channel = _CHANNEL.search(header)
            if channel is not None and channel.group(1) == "analysis":
                continue  # reasoning, whoever it is addressed to
            if recipient is not None:
                target = recipient.group(1)
                if not target.startswith("functions."):
                    calls.append(malformed(f"unknown recipient {target!r} (tools are called as to=functions.NAME)"))
                    continue
                name = target[len("functions."):]
                calls.append(call_from_json_text(body.strip(), f"the arguments of {name}", name))
            else:
                content.append(body)
        return ParsedTurn("".join(content), tuple(calls))


def _messages(text: str) -> list[tuple[str, str]]:
    """(header, body) of each message; the first one's `<|start|>assistant` is in the prompt."""
    out = []
    for chunk in text.split("<|start|>"):
        if not chunk.strip():
            continue
        header, sep, body = chunk.partition("<|message|>")
        if not sep:  # no header: plain text (a model that skipped the channel markup)
            out.append(("", _ENDS.split(chunk, 1)[0]))
            continue
        out.append((header, _ENDS.split(body, 1)[0]))
    return out
