"""The main job: roll out a JSONL of prompts, write the samples, print a summary.

With no `--server`, the embedded SGLang-compatible server is started on a free
loopback port with the shipped demo replay, and stopped at the end. Samples are
written as they finish to `OUTPUT.partial`, renamed to OUTPUT at the end or on Ctrl-C,
so OUTPUT is never half-written and what finished is kept.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from importlib import resources
from typing import Any

import httpx

from engine.config import EngineConfig, RetryPolicy
from engine.loop.runtime import Runtime
from engine.local.sample import Sample
from engine.slime.sample_io import clear_sample
from engine.slime import reward_func, run_sample
from engine.trace.summary import format_summary, summarize


def demo_file(name: str) -> str:
    """Path of a file of the shipped demo (prompts.jsonl, replay.jsonl)."""
    return str(resources.files("engine.local") / "demo" / name)


def read_prompts(path: str) -> list[Sample]:
    """One Sample per line; a line that is not a JSON object becomes a FAILED sample, not an exit."""
    samples: list[Sample] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            sample = Sample(index=len(samples), session_id=uuid.uuid4().hex)
            try:
                row = json.loads(line)
                if not isinstance(row, dict) or "prompt" not in row:
                    raise ValueError('each line must be a JSON object with a "prompt"')
                sample.prompt, sample.label = row["prompt"], row.get("label")
                sample.metadata = dict(row.get("metadata") or {})
            except ValueError as exc:
                clear_sample(sample)
                sample.status = Sample.Status.FAILED
                sample.metadata = {"fsm": {"termination_reason": "bad_input_line", "engine_error": f"line {n + 1}: {exc}"}}
            samples.append(sample)
    return samples


def server_context_length(url: str) -> int | None:
    """The server's context length from `/server_info` (or its old alias); None if not told."""
    for route in ("/server_info", "/get_server_info"):
        try:
            info = httpx.get(url.rstrip("/") + route, timeout=10, trust_env=False).json()
        except (httpx.HTTPError, ValueError):
            continue
        if isinstance(info, dict) and isinstance(info.get("context_length"), int):
            return info["context_length"]
    return None


def check_reachable(url: str) -> str | None:
    """None when the server answers `/health`, else a sentence saying what went wrong."""
    try:
        httpx.get(url.rstrip("/") + "/health", timeout=10, trust_env=False)
    except httpx.HTTPError as exc:
        return f"cannot reach the server at {url}: {type(exc).__name__}: {exc}"
    return None


@contextlib.contextmanager
def embedded_server(ns: argparse.Namespace) -> Iterator[str]:
    """Start the demo server on a free loopback port unless `--server` was given."""
    if ns.server:
        yield ns.server
        return
    from engine.local.server import BackgroundServer, ServerSettings

    replay = ns.replay or demo_file("replay.jsonl")
    print(f"starting the embedded server (tiny Qwen3 on the CPU, replay {os.path.basename(replay)})...", file=sys.stderr)
    with BackgroundServer(ServerSettings(port=0, replay_path=replay, tokenizer_path=ns.tokenizer)) as server:
        yield server.url


async def roll_out(samples: list[Sample], cfg: EngineConfig, params: dict[str, Any], out_path: str, progress: bool) -> float:
    """Run every pending sample; append each finished one to `out_path` as it ends."""
    rt = Runtime.create(cfg)
    gate = asyncio.Semaphore(cfg.max_connections)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(samples), unit="sample", file=sys.stderr)
    started = time.perf_counter()
    with open(out_path, "w", encoding="utf-8") as out:

        def emit(sample: Sample) -> None:
            out.write(json.dumps(sample.to_dict(), ensure_ascii=False) + "\n")
            out.flush()
            if bar is not None:
                bar.update(1)

        async def one(sample: Sample) -> None:
            async with gate:
                await run_sample(rt, sample, dict(params))
                if sample.status.name in ("COMPLETED", "TRUNCATED", "FAILED"):
                    sample.reward = await reward_func(None, sample)
            emit(sample)

        for sample in samples:
            if sample.status is not Sample.Status.PENDING:
                emit(sample)  # a bad input line: recorded, not rolled out
        tasks = [asyncio.create_task(one(s)) for s in samples if s.status is Sample.Status.PENDING]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await rt.aclose()
            if bar is not None:
                bar.close()
    return time.perf_counter() - started


def main_run(ns: argparse.Namespace) -> int:
    """`python -m engine run`: see the module docstring."""
    in_path = ns.input or demo_file("prompts.jsonl")
    if not os.path.isfile(in_path):
        print(f"error: no such input file: {in_path}", file=sys.stderr)
        return 2
    samples = read_prompts(in_path)[: ns.limit] if ns.limit else read_prompts(in_path)
    partial = ns.output + ".partial"
    interrupted, wall = False, float("nan")
    try:
        with embedded_server(ns) as url:
            problem = check_reachable(url)
            if problem:
                print(f"error: {problem}", file=sys.stderr)
                return 2
            cfg = EngineConfig(
                server_url=url,
                profile=ns.profile,
                max_turns=ns.max_turns,
                max_tool_calls=ns.max_tool_calls,
                max_context_len=ns.max_context or server_context_length(url),
                tool_timeout=ns.tool_timeout,
                max_connections=max(1, ns.concurrency),
                retry=RetryPolicy(max_attempts=4, deadline=60.0),
                tokenizer_path=ns.tokenizer,
            )
            params = {"temperature": ns.temperature, "top_p": 1.0, "max_new_tokens": ns.max_new_tokens,
                      "no_stop_trim": True, "skip_special_tokens": False, "spaces_between_special_tokens": False}
            wall = asyncio.run(roll_out(samples, cfg, params, partial, progress=not ns.no_progress))
    except KeyboardInterrupt:  # Ctrl-C: keep what finished, under the final name
        interrupted = True
    if not os.path.exists(partial):
        print("interrupted before any sample finished: nothing written", file=sys.stderr)
        return 130
    os.replace(partial, ns.output)
    with open(ns.output, encoding="utf-8") as f:
        done = [json.loads(line) for line in f]
    print(format_summary(summarize(done, wall_seconds=wall)))
    print(f"\nwrote {len(done)} sample(s) to {ns.output}" + (" (interrupted: the rest were not run)" if interrupted else ""))
    return 130 if interrupted else 0
