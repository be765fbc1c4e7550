"""What a profile is: how prompts are rendered, turns parsed and observations written."""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, Protocol

import attrs

TurnKind = Literal["answer", "tool", "invalid"]


@attrs.frozen
class ToolCall:
    """One call the model asked for. `error` is set when the call could not be parsed."""

    name: str
    arguments: Any = attrs.field(factory=dict)
    error: str | None = None  # e.g. "malformed_call": answered with an error observation
    detail: str = ""  # what was wrong, for the model to read
    id: str | None = attrs.field(default=None, eq=False)  # the call's id where the format writes one (Mistral, Kimi K2)


@attrs.frozen
class Turn:
    """What one model turn asks for: a final answer, tool calls, or nothing usable."""

    action: TurnKind
    calls: tuple[ToolCall, ...] = ()
    answer: str | None = None
    foreign: str | None = None  # an answer holding a call in another format than configured (that parser's name)


class TurnReading(NamedTuple):
    """One model turn split as SGLang serves it: the reasoning (`reasoning_content`), the text
    outside reasoning and calls (`content`), and the calls read from outside the reasoning."""

    reasoning: str
    content: str
    calls: tuple[ToolCall, ...]


@attrs.frozen
class CallResult:
    """The answer to one call: text for the model, the error kind (None on success)."""

    call: ToolCall
    text: str
    error: str | None = None
    stats: dict[str, float] = attrs.field(factory=dict, eq=False)  # what the tool counted (`tools.count`)
    reward: float | None = None  # the tool's reward for the turn that called it (`ToolResult.reward`)


class Profile(Protocol):
    """A prompt and tool-call format. `retool` and `chat` ship; others plug in by name."""

    name: str

    def render_prompt(self, prompt: Any, tools: list[dict[str, Any]]) -> list[int]:
        """Token ids of the prompt, the tools' schemas included."""
        ...

    def parse_turn(self, text: str) -> Turn:
        """Read one model turn's text."""
        ...

    def observation_ids(self, turn: Turn, results: list[CallResult], last_token: int | None) -> list[int]:
        """Token ids to append after the turn (mask 0): tool results or an invalid-action note.

        `last_token` is the turn's last token, so a template can close a turn that ended on a
        stop string rather than on its end-of-turn token.
        """
        ...

    def decode(self, ids: list[int]) -> str:
        """The text of token ids, special tokens kept (as slime keeps them)."""
        ...

