"""slime's own agent adapter beside the engine's sessions, on the same sessions, against the embedded server.

Run as a script with a slime checkout on PYTHONPATH (tests/agent/test_slime_side_by_side.py does):
it starts the embedded server with the demo's agent replay, then runs each harness variant on
each demo prompt twice, once through slime's `OpenAIAdapter` (its aiohttp app, its
`TrajectoryManager`) and once through the engine's front door, and prints one JSON object:
per side and variant, the samples per session, the tokens they hold and the tokens they train.

slime's adapter reads tool calls and reasoning with SGLang's parsers. Where SGLang is not
importable, a stand-in of the two it calls (the hermes-style `qwen25` detector, the `qwen3`
reasoning parser) is put in its place, in this process only; the JSON says which was used.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import sys
import types
from typing import Any

VARIANTS = {"verbatim": "tests.support.agent_harnesses:add_task",
            "reasoning_dropped": "tests.support.agent_harnesses:forgetful",
            "compacted": "tests.support.agent_harnesses:compacting"}
SAMPLING = {"max_new_tokens": 256, "temperature": 1.0, "no_stop_trim": True, "skip_special_tokens": False}


def install_sglang_stand_in() -> bool:
    """SGLang's parsers that slime's adapter imports, stood in for when SGLang is absent; True if done."""
    if importlib.util.find_spec("sglang") is not None:
        return False

    class ToolCallItem:
        def __init__(self, name: str, parameters: str) -> None:
            self.name, self.parameters = name, parameters

    class FunctionCallParser:
        """The hermes-style detector: `<tool_call>{"name", "arguments"}</tool_call>` blocks."""

        def __init__(self, tools: Any, tool_call_parser: str) -> None:
            self.tools = tools

        def has_tool_call(self, text: str) -> bool:
            return "<tool_call>" in text

        def parse_non_stream(self, text: str) -> tuple[str, list[ToolCallItem]]:
            calls = []
            for body in re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.DOTALL):
                data = json.loads(body)
                calls.append(ToolCallItem(data["name"], json.dumps(data.get("arguments", {}))))
            return text[:text.find("<tool_call>")].strip(), calls

    class ReasoningParser:
        """The qwen3 reasoning parser: what comes before `</think>`."""

        def __init__(self, model_type: str, stream_reasoning: bool = False) -> None:
            pass

        def parse_non_stream(self, text: str) -> tuple[str, str]:
            if "</think>" not in text:
                return "", text
            reasoning, rest = text.split("</think>", 1)
            return reasoning.replace("<think>", "").strip(), rest.strip()

    class Function:
        def __init__(self, **kw: Any) -> None:
            self.__dict__.update(kw)

    class Tool:
        def __init__(self, type: str, function: Any) -> None:
            self.type, self.function = type, function

    modules = {
        "sglang": {}, "sglang.srt": {}, "sglang.srt.parser": {}, "sglang.srt.function_call": {},
        "sglang.srt.entrypoints": {}, "sglang.srt.entrypoints.openai": {},
        "sglang.srt.parser.reasoning_parser": {"ReasoningParser": ReasoningParser},
        "sglang.srt.function_call.function_call_parser": {"FunctionCallParser": FunctionCallParser},
        "sglang.srt.entrypoints.openai.protocol": {"Function": Function, "Tool": Tool},
    }
    for name, attributes in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attributes)
        sys.modules[name] = module
    return True


def session_figures(samples: list[Any]) -> dict[str, Any]:
    """What a session's samples hold: how many, their tokens, their trained tokens."""
    return {"samples": len(samples), "tokens": sum(len(s.tokens) for s in samples),
            "trained": sum(sum(s.loss_mask or ()) for s in samples)}


async def slime_side(server_url: str, tokenizer: Any, prompts: list[str]) -> dict[str, list[dict[str, Any]]]:
    from aiohttp import web
    from slime.agent.adapters import OpenAIAdapter
    from slime.utils.types import Sample

    from engine.agent.harness import HarnessSpec

    out: dict[str, list[dict[str, Any]]] = {}
    for variant, target in VARIANTS.items():
        adapter = OpenAIAdapter(tokenizer=tokenizer, sglang_url=server_url, tool_parser="qwen25", reasoning_parser="qwen3")
        runner = web.AppRunner(adapter.app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        fn = HarnessSpec.parse(target).function()
        rows = []
        for i, prompt in enumerate(prompts):
            sid = f"{variant}-{i}"
            adapter.open_session(sid, sampling_defaults=dict(SAMPLING))
            await fn(f"http://127.0.0.1:{port}", sid, types.SimpleNamespace(prompt=prompt))
            samples = await adapter.finish_session(sid, base_sample=Sample(index=i, prompt=prompt))
            rows.append(session_figures(samples))
        await runner.cleanup()
        out[variant] = rows
    return out


async def engine_side(server_url: str, tokenizer: Any, prompts: list[str]) -> dict[str, list[dict[str, Any]]]:
    from engine.agent.harness import HarnessSpec
    from engine.agent.serving import close_served, run_agent
    from engine.local.sample import Sample
    from engine.loop.runtime import Runtime
    from engine.settings import EngineConfig
    from engine.slime.sample_io import write_segments

    out: dict[str, list[dict[str, Any]]] = {}
    rt = Runtime.create(EngineConfig(server_url=server_url, profile="chat", max_context_len=4096), tokenizer=tokenizer)
    try:
        for variant, target in VARIANTS.items():
            rows = []
            for i, prompt in enumerate(prompts):
                sample = Sample(index=i, prompt=prompt)
                run = await run_agent(rt, HarnessSpec.parse(target), prompt=prompt, sampling_params=dict(SAMPLING),
                                      sample=sample)
                assert run.rollout is not None, run.outcome
                samples = write_segments(sample, run.rollout, rt.profile.decode, requeued=False)
                rows.append({**session_figures(samples), "breaks": [s.metadata["fsm"]["termination_reason"]
                                                                     for s in samples[:-1]]})
            out[variant] = rows
    finally:
        await close_served(rt)
        await rt.aclose()
    return out


def main() -> None:
    from engine.local.demos import demo_file
    from engine.local.server import BackgroundServer, ServerSettings
    from engine.profiles.tokenizer import load_tokenizer

    stood_in = install_sglang_stand_in()
    prompts = [json.loads(line)["prompt"] for line in open(demo_file("agent-prompts.jsonl"))]
    tokenizer = load_tokenizer(None)
    with BackgroundServer(ServerSettings(port=0, replay_path=demo_file("replay-agent.jsonl"), context_length=4096)) as server:
        slime = asyncio.run(slime_side(server.url, tokenizer, prompts))
        engine = asyncio.run(engine_side(server.url, tokenizer, prompts))
    print(json.dumps({"sglang_stand_in": stood_in, "prompts": prompts, "slime": slime, "engine": engine}))


if __name__ == "__main__":
    main()
