"""The example environment: a simulated user, played by a second model (tau-bench style).

    engine_environment: user_simulator
    engine_user_sim_url: http://127.0.0.1:30001     # the second model
    engine_user_sim_api: chat                        # or generate (SGLang's /generate)

The sample's prompt is the user's first message; `metadata["user_instructions"]` (if any)
tells the simulated user who it is and what it wants. Each model turn that is not a tool call
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


class UserSimulator(envs.Environment):
    """A simulated user: a second model that answers each turn of the policy that is not a tool call."""

    name = "user_simulator"

    def __init__(self, url: str | None = None, api: str = "chat", model: str = "default", temperature: float = 0.7,
                 max_tokens: int = 256, timeout: float = 120.0, http: envs.HttpClient | None = None) -> None:
        self.url, self.api, self.model = url, api, model
        self.temperature, self.max_tokens, self.timeout = temperature, max_tokens, timeout
        self.http = http  # the engine's client, given to `setup`

    def setup(self, settings: Any, http: envs.HttpClient | None = None) -> UserSimulator:
        """A simulator configured by the engine's settings (`engine_user_sim_*`), asking through `http`."""
        url = getattr(settings, "user_sim_url", None)
        if not url:
            raise ValueError("engine_environment user_simulator needs engine_user_sim_url (the second model's URL)")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"engine_user_sim_url {url!r} is not an http:// or https:// URL")
        return UserSimulator(url.rstrip("/"), getattr(settings, "user_sim_api", "chat"),
                             getattr(settings, "user_sim_model", "default"), getattr(settings, "user_sim_temperature", 0.7),
                             getattr(settings, "user_sim_max_tokens", 256), getattr(settings, "tool_timeout", 120.0), http)

    async def start(self, prompt: Any, metadata: Mapping[str, Any]) -> list[dict[str, str]]:
        """The simulated user's side of the conversation: its instructions and its first message."""
        instructions = metadata.get("user_instructions") if isinstance(metadata, Mapping) else None
        system = SYSTEM.format(instructions=f"{instructions.strip()} " if isinstance(instructions, str) and instructions.strip() else "")
        if isinstance(prompt, list):
            said = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
            first = str(said[-1].get("content", "")) if said else ""
        else:
            first = str(prompt)
        return [{"role": "system", "content": system}, {"role": "assistant", "content": first}]

    async def respond(self, episode: list[dict[str, str]], text: str) -> envs.Reply:
        """Ask the second model for the user's next message."""
        episode.append({"role": "user", "content": clean(text)})
        message = await (self._chat(episode) if self.api == "chat" else self._generate(episode))
        episode.append({"role": "assistant", "content": message})
        if STOP in message:
            return envs.Reply(done=True, reason="user_stopped")
        return envs.Reply(message)

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        if self.http is None:
            raise envs.EnvironmentFailed("user simulator: no HTTP client (the engine gives its own to setup)")
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
