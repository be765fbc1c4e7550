"""A model call of an agent, whatever protocol it came in: the seam between the front door and the sessions.

The protocol side (an app serving `/v1/chat/completions`, `/v1/responses`, `/v1/messages`)
turns a request into a `ModelCall` and hands it to `Sessions.call` under the session key the
request carried; it turns the `ModelAnswer` back into that protocol's reply, streamed or not, and a
`CallRefused` into that protocol's error shape and status. The session side matches the call's
history onto what the session's sample has sampled so far, appends what the harness added as an
observation (mask 0), generates the model's turn and answers. Nothing here knows a protocol's wire
shapes, and the protocol side never sees a token id.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import attrs

Role = Literal["system", "user", "assistant", "tool"]
FinishReason = Literal["stop", "tool_calls", "length"]


@attrs.frozen
class Part:
    """One piece of a message's content: text, or an image the harness sent (kept, never flattened)."""

    kind: Literal["text", "image"]
    text: str = ""
    image: str | None = None  # an image's URL or data URL, as the harness sent it


@attrs.frozen
class CallMade:
    """A tool call in an assistant message of the history (or of an answer): its id, the tool and
    the arguments as JSON text, exactly as written (the matcher decides what counts as the same)."""

    id: str
    name: str
    arguments: str


@attrs.frozen
class Message:
    """One message of a call's history, in the protocols' common shape.

    `content` is text, or parts where the harness sent more than text. An assistant message may
    carry `reasoning` (OpenAI's `reasoning_content`, Anthropic's thinking blocks) and `calls`; a
    tool message answers the call `call_id` (OpenAI's `tool_call_id`, Anthropic's `tool_use_id`),
    `error` set where the harness marked the result an error (Anthropic's `is_error`).
    """

    role: Role
    content: str | tuple[Part, ...] = ""
    reasoning: str | None = None
    calls: tuple[CallMade, ...] = ()
    call_id: str | None = None
    name: str | None = None
    error: bool = False

    def text(self) -> str:
        """The content's text (the text parts joined); an image part has none."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if p.kind == "text")


@attrs.frozen
class ModelCall:
    """One request of a harness to the model, protocol-neutral.

    `messages` is the whole history the harness sends, system prompt first (Anthropic's `system`
    becomes a system message). `tools` are the tools offered, as function schemas in OpenAI's shape
    (`{"type": "function", "function": {"name", "description", "parameters"}}`). `sampling` holds
    what the request asked (`max_tokens`, `temperature`, `top_p`, `stop`, ...) under SGLang's names
    (`max_new_tokens`, ...). `retry_of` identifies a retry of an earlier request (the SDKs'
    `x-stainless-retry-count` > 0, with a digest of the body): it is answered with that request's
    answer, never a second turn. `protocol` names the door it came through, for records and errors.
    `tool_choice` is what the harness asked of the tools (the door checked that a named tool is
    offered; nothing enforces it on the sampled turn). `template_kwargs`: a chat request's own
    `chat_template_kwargs`, served only when they render as the job's do. Call ids in `messages` are the session's own:
    the door writes a session id `X` as the protocol's `call_X` / `toolu_X` and strips that prefix
    from the ids a harness sends back.
    """

    messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...] = ()
    sampling: dict[str, Any] = attrs.field(factory=dict)
    protocol: Literal["chat", "responses", "messages"] = "chat"
    model: str = ""
    retry_of: str | None = None
    digest: str = ""  # a digest of the request body: what a retry must repeat
    tool_choice: str = "auto"  # "auto", "none", "required", or the name of the one tool the harness asked for
    template_kwargs: dict[str, Any] | None = None  # the chat template's variables the request named (SGLang's extension)


@attrs.frozen
class Usage:
    """Token counts of one answer, as the protocols report them."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@attrs.frozen
class ModelAnswer:
    """The model's turn, read as the configured parser reads it.

    `text` is the content outside reasoning and calls; `reasoning` the reasoning the reasoning
    parser split off (None when there is none); `calls` the tool calls with ids the session made
    (the protocol writes them as its own: `call_...`, `toolu_...`). `finish` is why the turn ended:
    "length" when it hit its token cap or a budget ran out (the protocol says so in its own way).
    `stop_sequence` is the call's own stop string the turn ended on, if it ended on one (Messages
    answers it as `stop_reason: "stop_sequence"`).
    """

    text: str
    reasoning: str | None = None
    calls: tuple[CallMade, ...] = ()
    finish: FinishReason = "stop"
    usage: Usage = Usage(0, 0)
    id: str = ""  # the answer's id, stable across a retried request
    stop_sequence: str | None = None


@attrs.frozen
class CallRefused:
    """A call the session will not answer: the protocol's error shape with this status and message.

    `kind`: "invalid_request" (400: the history or content cannot be rendered, a schema error),
    "not_found" (404: no such session or model), "unauthorized" (401: a key never opened),
    "over_budget" (400: nothing is left of the context), "closed" (409: the session has ended).
    """

    kind: Literal["invalid_request", "not_found", "unauthorized", "over_budget", "closed"]
    message: str

    @property
    def status(self) -> int:
        return {"invalid_request": 400, "not_found": 404, "unauthorized": 401, "over_budget": 400, "closed": 409}[self.kind]


class Sessions(Protocol):
    """What the front door asks of the sessions behind it."""

    async def call(self, key: str, call: ModelCall) -> ModelAnswer | CallRefused:
        """Answer one model call of the session `key` (one turn of its machine)."""
        ...

    async def count_tokens(self, key: str, call: ModelCall) -> int | CallRefused:
        """How many tokens the call's prompt holds, rendered as the session would render it."""
        ...

    def models(self) -> list[str]:
        """The model names served (`/v1/models`)."""
        ...

    def notes(self, key: str) -> dict[str, Any] | None:
        """A dict kept with the session `key` for the door, gone with the session (None: no such
        session). The door keeps there what it read of the session's last request, so that the
        next one, which repeats that history, is read only for what it adds. Optional: sessions
        without it are served all the same, each request's history read whole."""
        ...
