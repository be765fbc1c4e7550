"""Shared test helpers: SGLang reply bodies, a scripted respx server, slime-like args."""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from engine import envs, tools
from engine.profiles.tokenizer import load_tokenizer

URL = "http://sglang.test:30000"
IM_END = 151645


def retool_schemas() -> list[dict[str, Any]]:
    """The tool schemas a retool prompt shows by default (built-ins but code_interpreter withheld)."""
    from engine.profiles.retool import RetoolProfile

    return [tools.get(n).schema() for n in tools.names() if n not in RetoolProfile.withheld_tools]  # type: ignore[union-attr]


def tok() -> Any:
    return load_tokenizer(None)


def encode(text: str) -> list[int]:
    return list(tok()(text, add_special_tokens=False)["input_ids"])


def fake_logprobs(ids: list[int], seed: int = 0) -> list[float]:
    """Distinct, exact-in-binary negative logprobs so equality checks are meaningful."""
    return [-((i * 7 + seed) % 97 + 1) / 64 for i, _ in enumerate(ids)]


def reply_body(
    ids: list[int],
    *,
    finish: str = "stop",
    logprobs: list[float] | None = None,
    weight_version: str = "default",
    with_logprobs: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """A `/generate` 200 body as SGLang 0.5.x writes it."""
    lps = fake_logprobs(ids, seed) if logprobs is None else logprobs
    finish_reason: dict[str, Any] = {"type": finish}
    if finish == "stop":
        finish_reason["matched"] = ids[-1] if ids else IM_END
    elif finish == "length":
        finish_reason["length"] = len(ids)
    else:
        finish_reason.update({"message": "Aborted", "status_code": None, "err_type": None})
    meta: dict[str, Any] = {
        "id": "rid",
        "finish_reason": finish_reason,
        "prompt_tokens": 10,
        "weight_version": weight_version,
        "completion_tokens": len(ids),
        "cached_tokens": 0,
        "e2e_latency": 0.01,
    }
    if with_logprobs:
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [[lp, i, None] for lp, i in zip(lps, ids)]
        meta["output_token_logprobs_length"] = len(ids)
    return {"text": tok().decode(ids), "output_ids": list(ids), "meta_info": meta}


def turn(text: str, *, finish: str = "stop", eos: bool = True, **kw: Any) -> httpx.Response:
    """A reply whose tokens are `text` (plus <|im_end|> when it stopped on EOS)."""
    ids = encode(text) + ([IM_END] if eos and finish == "stop" else [])
    return httpx.Response(200, json=reply_body(ids, finish=finish, **kw))


def profile_turn(profile: Any, text: str) -> httpx.Response:
    """A reply whose tokens are `text` in `profile`'s tokenizer, closed by the token that ends its
    template's turn (the closer, else the EOS), with fixed logprobs."""
    ids = profile.encode(text) + [profile.closer_id if profile.closer_id is not None else profile.eos_id]
    meta = {"id": "rid", "finish_reason": {"type": "stop", "matched": ids[-1]}, "prompt_tokens": 10,
            "weight_version": "default", "completion_tokens": len(ids), "cached_tokens": 0, "e2e_latency": 0.01,
            "input_token_logprobs": [], "output_token_logprobs": [[-0.25, i, None] for i in ids],
            "output_token_logprobs_length": len(ids)}
    return httpx.Response(200, json={"text": text, "output_ids": ids, "meta_info": meta})


Scripted = httpx.Response | Exception | Callable[[dict[str, Any]], httpx.Response]


class ScriptedServer:
    """A respx side effect answering `/generate` from a script, recording every request and, of
    each reply it served whole, the output ids and logprobs (`replies`: the server's record)."""

    def __init__(self, script: list[Scripted], *, repeat_last: bool = False) -> None:
        self.script = list(script)
        self.repeat_last = repeat_last
        self.requests: list[dict[str, Any]] = []
        self.headers: list[httpx.Headers] = []
        self.replies: list[tuple[list[int], list[float]]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        payload = json.loads(request.content)
        self.requests.append(payload)
        self.headers.append(request.headers)
        if not self.script:
            raise AssertionError(f"unexpected request #{len(self.requests)}")
        item = self.script[0] if self.repeat_last and len(self.script) == 1 else self.script.pop(0)
        if isinstance(item, Exception):
            raise item
        if callable(item) and not isinstance(item, httpx.Response):
            item = item(payload)
            if inspect.isawaitable(item):  # an async side effect: respx awaits what we return
                return self._record_when_done(item)
        return self._record(item)

    async def _record_when_done(self, pending: Awaitable[httpx.Response]) -> httpx.Response:
        return self._record(await pending)

    def _record(self, response: httpx.Response) -> httpx.Response:
        if response.status_code == 200:
            try:
                pairs = json.loads(response.content)["meta_info"]["output_token_logprobs"]
            except (ValueError, KeyError, TypeError, IndexError, httpx.ResponseNotRead):
                return response  # not a reply the engine can take (or a stream): nothing recorded
            self.replies.append(([int(p[1]) for p in pairs], [float(p[0]) for p in pairs]))
        return response

    def roll_out(self, config: Any, tokenizer: Any, sample: Any) -> Any:
        """Run `sample` through a runtime built from `config` and `tokenizer`, with this script
        answering `/generate` at URL; the runtime's profile, for the caller's checks."""
        import respx

        from engine.loop.runtime import Runtime
        from engine.slime import run_sample

        async def go() -> Any:
            with respx.mock(assert_all_called=False) as mock:
                mock.post(URL + "/generate").mock(side_effect=self)
                rt = Runtime.create(config, tokenizer=tokenizer)
                try:
                    await run_sample(rt, sample, dict(SAMPLING))
                finally:
                    await rt.aclose()
                return rt.profile

        return asyncio.run(go())


def make_args(**overrides: Any) -> argparse.Namespace:
    """slime's args as a generate function sees them, pointed at the mocked server."""
    base: dict[str, Any] = {
        "sglang_router_ip": "sglang.test",
        "sglang_router_port": 30000,
        "rollout_max_context_len": 4096,
        "hf_checkpoint": None,
        "partial_rollout": False,
        "sglang_server_concurrency": 64,
        "engine_retry_attempts": 3,
        "engine_retry_deadline": 5.0,
        "engine_retry_base_delay": 0.01,
    }
    base.update(overrides)
    return argparse.Namespace(**base)


SAMPLING = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 256, "no_stop_trim": True, "skip_special_tokens": False}


class FakeInterpreter(tools.Tool):
    """Stands in for the sandbox where a test is about the engine, not the sandbox."""

    name = "code_interpreter"
    description = "A tool for executing Python code in a safe sandbox environment."
    parameters = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}

    def __init__(self, output: Callable[[str], str] | None = None) -> None:
        self.output = output or (lambda code: f"Output:\n{code}")
        self.codes: list[str] = []

    async def execute(self, state: Any, **arguments: Any) -> str:
        self.codes.append(arguments["code"])
        return self.output(arguments["code"])


class StubHarness:
    """Stands in for an agent's session where a test is about the machine: records each turn it is
    given to answer and hands back scripted `HarnessEvent`s, then the harness's normal end."""

    def __init__(self, events: list[Any]) -> None:
        self.events = list(events)
        self.answered: list[str] = []

    async def exchange(self, r: Any) -> Any:
        from engine.machine.rollout import HarnessEvent

        self.answered.append(r.turn.text)
        return self.events.pop(0) if self.events else HarnessEvent("end", reason="harness_finished")


class EchoEnvironment(envs.Environment):
    """An environment for edge tests: repeats the turn back once, then ends the episode."""

    name = "echo_test"

    async def start(self, task: envs.Task) -> list[str]:
        return []

    async def respond(self, episode: list[str], conversation: envs.Conversation) -> envs.Reply:
        episode.append(conversation.text)
        return envs.Reply(done=True, reason="heard twice") if len(episode) > 1 else envs.Reply("You said: " + conversation.text)


envs.register_environment(EchoEnvironment(), replace=True)
