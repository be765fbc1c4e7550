"""The example environment: a simulated user, played by a second model (tau-bench style).

    engine_environment: user_simulator
    engine_user_sim_url: http://127.0.0.1:30001     # the second model
    engine_user_sim_api: chat                        # or generate (SGLang's /generate)

The sample's prompt is the user's first message; `user_instructions` (the environment's args
for the sample, else the sample's `metadata["user_instructions"]`) tells the simulated user who
it is and what it wants. Each model turn that is not a tool call
goes to the second model, with the roles swapped (the policy speaks as "user" there), and its
answer comes back as the next user turn. The user ends the episode by writing `###STOP###`
(reason `user_stopped`). With `api: chat` the second model is asked through an
OpenAI-compatible `/v1/chat/completions`; with `api: generate` through SGLang's `/generate`,
the conversation rendered as ChatML text (Qwen-style markup; use `chat` for other templates).

Its requests go through the engine's HTTP client (`setup`'s `http`): the loop's connection pool,
the reply cap (`engine_max_reply_bytes`) and the retry policy (`engine_retry_*`) of `/generate`.
A simulator that fails (the connection refused, an HTTP error after the retries, no answer
within `engine_tool_timeout`, a body that is not what the API returns, an empty message) raises
`EnvironmentFailed`: the engine ends the sample with that reason recorded, never a crash.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from engine.envs import base as envs
from engine.settings import EngineConfig, setting, settings
from engine.settings.declare import URL, default_of

STOP = "###STOP###"
SYSTEM = (
    "You are a user talking to an AI assistant. Stay in your role: write only your next message to the "
    "assistant, briefly. {instructions}When your request has been handled, or you want to give up, "
    f"write {STOP}."
)
_MARKUP = re.compile(r"<think>.*?</think>|<\|[^|>]*\|>", re.DOTALL)


def clean(text: str) -> str:
    """The policy's turn as the user reads it: no reasoning block, no chat markup tokens."""
    return _MARKUP.sub("", text).strip()


def chatml(messages: list[dict[str, str]]) -> str:
    """Messages as ChatML text, ready for the next assistant message."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


@settings(prefix="engine_user_sim_")
class UserSimulatorSettings:
    """The user_simulator environment (engine_environment: user_simulator)."""

    url: str | None = setting(kind=URL, help="the second model's URL")
    api: str = setting("chat", choices=("chat", "generate"), help="chat (/v1/chat/completions) or generate (SGLang's /generate)")
    model: str = setting("default", help="the model name sent to the chat API")
    temperature: float = setting(0.7, low=0, high=100, help="sampling temperature")
    max_tokens: int = setting(256, low=1, high=10**6, help="tokens per user message")


class UserSimulator(envs.Environment):
    """A simulated user: a second model that answers each turn of the policy that is not a tool call."""

    name = "user_simulator"
    Settings = UserSimulatorSettings

    def __init__(self, settings: UserSimulatorSettings | None = None,
                 timeout: float = default_of(EngineConfig, "tool_timeout"), http: envs.HttpClient | None = None) -> None:
        settings = settings or UserSimulatorSettings()
        self.url, self.api, self.model = settings.url, settings.api, settings.model
        self.temperature, self.max_tokens, self.timeout = settings.temperature, settings.max_tokens, timeout
        self.http = http  # the engine's client, handed to `setup`

    def setup(self, cfg: Any, settings: UserSimulatorSettings | None = None,
              http: envs.HttpClient | None = None) -> UserSimulator:
        """A simulator for one runtime: its own settings (`engine_user_sim_*`), the engine's tool
        timeout, and the engine's HTTP client to ask the second model through."""
        settings = settings or UserSimulatorSettings()
        if not settings.url:
            raise ValueError("engine_environment user_simulator needs engine_user_sim_url (the second model's URL)")
        return UserSimulator(settings, cfg.tool_timeout, http)

    async def start(self, task: envs.Task) -> list[dict[str, str]]:
        """The simulated user's side of the conversation: its instructions and its first message."""
        metadata, prompt = task.metadata, task.prompt
        instructions = task.args.get("user_instructions") or (metadata.get("user_instructions") if isinstance(metadata, Mapping) else None)
        system = SYSTEM.format(instructions=f"{instructions.strip()} " if isinstance(instructions, str) and instructions.strip() else "")
        if isinstance(prompt, list):
            said = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
            first = str(said[-1].get("content", "")) if said else ""
        else:
            first = str(prompt)
        return [{"role": "system", "content": system}, {"role": "assistant", "content": first}]

    async def respond(self, episode: list[dict[str, str]], conversation: envs.Conversation) -> envs.Reply:
        """Ask the second model for the user's next message (it reads the policy's words, not its tool calls)."""
        episode.append({"role": "user", "content": clean(conversation.text)})
        message = await (self._chat(episode) if self.api == "chat" else self._generate(episode))
        episode.append({"role": "assistant", "content": message})
        if STOP in message:
            return envs.Reply(done=True, reason="user_stopped")
        return envs.Reply(message)

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        if self.http is None:
            raise envs.EnvironmentFailed("user simulator: no HTTP client (the engine hands its own to setup)")
        try:
            return await self.http.post_json(f"{self.url}{path}", body, timeout=self.timeout)
        except Exception as exc:  # the client says what failed: refused, an HTTP status, a body that is not JSON
            raise envs.EnvironmentFailed(f"user simulator at {self.url}{path}: {exc}") from None

    async def _chat(self, messages: list[dict[str, str]]) -> str:
        body = await self._post("/v1/chat/completions", {"model": self.model, "messages": messages,
                                                         "temperature": self.temperature, "max_tokens": self.max_tokens})
        try:
            content = body["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise envs.EnvironmentFailed("user simulator: the chat completion has no choices[0].message.content") from None
        return self._message(content)

    async def _generate(self, messages: list[dict[str, str]]) -> str:
        params = {"temperature": self.temperature, "max_new_tokens": self.max_tokens, "stop": ["<|im_end|>"]}
        body = await self._post("/generate", {"text": chatml(messages), "sampling_params": params})
        content = body.get("text") if isinstance(body, dict) else None
        return self._message(content)

    @staticmethod
    def _message(content: Any) -> str:
        if not isinstance(content, str):
            raise envs.EnvironmentFailed(f"user simulator: expected the message text, got {type(content).__name__}")
        message = clean(content)
        if not message:
            raise envs.EnvironmentFailed("user simulator: an empty message")
        return message


envs.register_environment(UserSimulator())
