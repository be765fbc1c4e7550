"""The `retool` profile: slime's retool example, reproduced so it is a drop-in replacement.

Same prompt text (Qwen chat markup, system prompt, tool spec), same turn formats
(`<tool_call>{json}</tool_call>`, `<code>...</code>`, a ```python block, the final
`Answer: \\boxed{...}`), same `<interpreter>` observations and invalid-action note.
Differences, each deliberate: a `<tool_call>` whose JSON does not parse gets an error
observation naming the problem instead of the generic invalid-action note, and JSON
with raw newlines inside strings is accepted without rewriting it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from engine.profiles.base import CallResult, ToolCall, Turn
from engine.profiles.tokenizer import Codec

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant that can use Python tools to solve mathematical problems. "
    "When you need to perform calculations, use the code_interpreter tool to execute code and get results."
)
INVALID_ACTION = (
    "\nMy previous action is invalid. If I want to execute code, I should put the code between "
    "<code> and </code>. If I want to give the final answer, I should use the format "
    "'Answer: \\boxed{answer}'. Let me try again.\n"
)
# One level of nested braces inside \boxed{...}, as the example accepts.
ANSWER_RE = re.compile(r"Answer:\s*\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}", re.DOTALL)
_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_CODE_RE = re.compile(r"<code>(.*?)</code>", re.DOTALL)
_PYTHON_BLOCK_RE = re.compile(r"```python\s*(.*?)\s*```", re.DOTALL)


def tojson(value: Any) -> str:
    """JSON as Jinja's `tojson` writes it (sorted keys, HTML-unsafe characters escaped)."""
    text = json.dumps(value, sort_keys=True)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").replace("'", "\\u0027")


def render_retool_prompt(prompt: Any, tools: list[dict[str, Any]]) -> str:
    """The example's prompt text, byte for byte (its template strips most newlines)."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
    system = next((m["content"] for m in messages if m.get("role") == "system"), DEFAULT_SYSTEM_PROMPT)
    parts = ["<|im_start|>system", system]
    if tools:
        parts.append(
            "\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
        )
        parts.extend(tojson(t) for t in tools)
        parts.append(
            "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
            'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
            '"arguments": <args-json-object>}\n</tool_call>'
        )
    parts.append("\n<|im_end|>")
    for message in messages:
        if message.get("role") in ("user", "assistant"):
            parts.append(f"\n<|im_start|>{message['role']}{message['content']}<|im_end|>")
    parts.append("\n<|im_start|>assistant")
    return "".join(parts)


def parse_retool_turn(text: str) -> Turn:
    """The example's action rules, in its order: answer, tool call, <code>, ```python."""
    answer = ANSWER_RE.search(text)
    if answer:
        return Turn("answer", answer=answer.group(1).strip())
    tool_call = _TOOL_CALL_RE.search(text)
    if tool_call:
        call = parse_tool_call_json(tool_call.group(1))
        # The example falls through to the other formats when the code is empty.
        args = call.arguments if isinstance(call.arguments, dict) else {}
        if not (call.name == "code_interpreter" and not str(args.get("code", "")).strip()):
            return Turn("tool", calls=(call,))
    for pattern in (_CODE_RE, _PYTHON_BLOCK_RE):
        match = pattern.search(text)
        if match:
            return Turn("tool", calls=(ToolCall("code_interpreter", {"code": match.group(1).strip()}),))
    return Turn("invalid")


def parse_tool_call_json(body: str) -> ToolCall:
    """A `{"name": ..., "arguments": {...}}` call; raw newlines inside strings are allowed."""
    try:
        data = json.loads(body, strict=False)
    except ValueError as exc:
        return ToolCall("", error="malformed_call", detail=f"tool call is not valid JSON: {exc}")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ToolCall("", error="malformed_call", detail='a tool call must be {"name": ..., "arguments": {...}}')
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models send arguments as a JSON string
        try:
            arguments = json.loads(arguments, strict=False)
        except ValueError:
            pass
    return ToolCall(data["name"], arguments)


class RetoolProfile:
    """slime's retool format over a tokenizer."""

    name = "retool"
    # Built-ins not offered unless `engine_tools` (or the sample) names them, so that by default
    # the prompt offers code_interpreter alone, byte for byte slime's example. Tools of your
    # own (engine_tool_modules) are offered.
    withheld_tools = ("python_session",)
    renders_sample_schemas = False  # the example always shows its own tool spec

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.codec = Codec(tokenizer)

    def render_prompt(self, prompt: Any, tools: list[dict[str, Any]]) -> list[int]:
        return self.encode(render_retool_prompt(prompt, tools))

    def parse_turn(self, text: str) -> Turn:
        return parse_retool_turn(text)

    def observation_text(self, turn: Turn, results: list[CallResult]) -> str:
        """The text appended after a turn: one `<interpreter>` block per call, or the note."""
        if turn.action == "invalid":
            return INVALID_ACTION
        return "".join(f"\n\n<interpreter>\n{r.text}\n</interpreter>\n\n" for r in results)

    def observation_ids(self, turn: Turn, results: list[CallResult], last_token: int | None = None) -> list[int]:
        """The observation as plain text: a special token printed by a tool stays text (issue 14)."""
        return self.codec.encode_plain(self.observation_text(turn, results))

    def user_turn_ids(self, text: str, last_token: int | None = None) -> list[int]:
        """An environment's reply as the next user turn, in the example's markup; the reply is
        plain text (a special token in it stays text), the markup around it is not."""
        im_end = self.codec.encode("<|im_end|>")
        closing = [] if [last_token] == im_end else im_end
        return (closing + self.codec.encode("\n<|im_start|>user") + self.codec.encode_plain(text)
                + self.codec.encode("<|im_end|>\n<|im_start|>assistant"))

    def encode(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.codec.decode(ids)
