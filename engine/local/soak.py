"""`python -m engine soak`: many samples through a faulty embedded server, each one checked.

The embedded server replays the demo's scripted turns (`engine/local/demo/replay.jsonl`) and injects
faults at the `--faults` rates (default: the `default` preset of `engine.local.server.faults`); the
tool calls run for real in the sandbox (`code_interpreter`). The client's request timeout is
shorter than an injected stall, so stalls end in client timeouts and retries.

Every finished sample is checked from the outside by `engine.local.invariants.sample_violations`:
I1-I4 and I6 re-derived from the sample's own fields with the tokenizer, against the usable
replies the server really sent for that sample (recorded from the wire by an httpx response
hook, keyed by the sample's routing key). Printed: counts by status and termination reason,
faults injected, retries, tool calls, wall time, peak RSS, and the figures that must be zero:
invariant violations, exceptions escaping `run_sample`, unfinished samples, and child
processes left behind (children of this process, or processes of the sandbox's uids, that
were not there before the run). Exit status 0 when all of those are zero and some tool call
succeeded, else 1; a sandbox whose check fails stops the soak before it starts (exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import re
import resource
import sys
import time
from typing import Any

import attrs
import httpx

from engine import tools
from engine.sglang.client import ROUTING_HEADER, make_http_client
from engine.settings import EngineConfig, RetryPolicy
from engine.local.invariants import sample_violations, status_name
from engine.profiles.retool import render_retool_prompt
from engine.local.demos import demo_file
from engine.loop.runtime import Runtime
from engine.local.sample import Sample
from engine.rollouts import sampling_params
from engine.slime.sample_io import engine_metadata
from engine.slime import run_sample
from engine.sandbox.runner import LOCK_DIR, UID_BASE, UID_COUNT

MAX_TURNS = 8
REQUEST_TIMEOUT = 2.0  # seconds; an injected stall (3 s by default) must outlast it
IN_FLIGHT = 16  # requests at once: the CPU server's replies then come well within REQUEST_TIMEOUT
PARAMS = sampling_params()  # slime's defaults
SHOWN = 10  # problems printed in full; the rest are counted


def usable_reply(content: bytes, vocab_size: int = 2**31) -> tuple[list[int], list[float]] | None:
    """The (ids, logprobs) of a 200 `/generate` body a trainer could use, else None.

    Written from the wire format, not with `engine.sglang.wire`, so the check does not lean on the
    code it checks: meta_info with a known finish reason, `[logprob, id, ...]` entries that
    agree with `output_ids`, ids inside the vocabulary and logprobs that are finite log-probabilities.
    """
    try:
        data = json.loads(content)
    except ValueError:
        return None
    if isinstance(data, list) and len(data) == 1:
        data = data[0]
    meta = data.get("meta_info") if isinstance(data, dict) else None
    finish = meta.get("finish_reason") if isinstance(meta, dict) else None
    if not isinstance(finish, dict) or finish.get("type") not in ("stop", "length", "abort"):
        return None
    entries = meta.get("output_token_logprobs")  # type: ignore[union-attr]
    try:
        ids = [int(e[1]) for e in entries]
        logprobs = [float(e[0]) for e in entries]
    except (TypeError, ValueError, IndexError):
        return None
    output_ids = data.get("output_ids")
    if output_ids is not None and list(output_ids) != ids or not all(-math.inf < lp <= 0.0 for lp in logprobs):
        return None  # NaN fails the comparison too
    if not all(0 <= i < vocab_size for i in ids):
        return None
    return ids, logprobs


@attrs.define
class WireRecorder:
    """httpx event hooks: the usable `/generate` replies each sample got, in order.

    `on_request` sees every request, answered or not: a request from the bare prompt starts a
    new attempt (the engine re-runs the sample from RESET), so only the replies from there on
    can be in the sample, even when that request itself is never answered (a timeout).
    """

    replies: dict[str, list[tuple[list[int], list[float]]]] = attrs.Factory(lambda: collections.defaultdict(list))
    prompt_lengths: dict[str, int] = attrs.Factory(dict)

    async def on_request(self, request: httpx.Request) -> None:
        key = request.headers.get(ROUTING_HEADER)
        if key is None or not request.url.path.endswith("/generate"):
            return
        sent = len(json.loads(request.content).get("input_ids") or [])
        if sent <= self.prompt_lengths.setdefault(key, sent):
            self.replies[key].clear()

    async def __call__(self, response: httpx.Response) -> None:
        key = response.request.headers.get(ROUTING_HEADER)
        if key is None or not response.request.url.path.endswith("/generate") or response.status_code != 200:
            return
        reply = usable_reply(await response.aread())  # read once; the client then reuses the bytes
        if reply is not None:
            self.replies[key].append(reply)


def leased_uids() -> set[int]:
    """Sandbox uids some run holds right now: their lease is an flock on a file in LOCK_DIR.

    Read from /proc/locks (`... FLOCK ... <major>:<minor>:<inode> ...`), so nothing is locked
    to find out, and other engines on the host are not disturbed.
    """
    files: dict[tuple[int, int, int], int] = {}
    try:
        for name in os.listdir(LOCK_DIR):
            st = os.stat(os.path.join(LOCK_DIR, name))
            if name.isdigit():
                files[(os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)] = int(name)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    held = set()
    for line in lines:
        match = re.search(r"\b([0-9a-f]+):([0-9a-f]+):(\d+)\b", line)
        if "FLOCK" in line and match:
            key = (int(match[1], 16), int(match[2], 16), int(match[3]))
            if key in files:
                held.add(files[key])
    return held


def watched_processes() -> dict[int, str]:
    """Processes a run could have left: our children (any state, zombies included), and live
    processes of the sandbox's uids that no run holds (a held uid belongs to a run in progress,
    maybe another engine's on this host). By pid, with a description."""
    me, found, held = os.getpid(), {}, leased_uids()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
            ppid, uid, state = int(fields["PPid"]), int(fields["Uid"].split()[0]), fields["State"]
        except (OSError, KeyError, ValueError):
            continue  # gone meanwhile
        sandboxed = UID_BASE <= uid < UID_BASE + UID_COUNT and uid not in held and not state.startswith("Z")
        if ppid == me or sandboxed:  # a sandbox zombie is dead: its new parent (init) reaps it
            found[int(entry)] = f"pid {entry} {fields.get('Name', '?')} uid {uid} ppid {ppid} {state}"
    return found


@attrs.define
class SoakResult:
    """Everything the soak measured; `ok` when every must-be-zero figure is zero."""

    samples: int
    concurrency: int
    faults: str
    wall_seconds: float = 0.0
    statuses: collections.Counter[str] = attrs.Factory(collections.Counter)
    reasons: collections.Counter[str] = attrs.Factory(collections.Counter)
    faults_injected: dict[str, int] = attrs.Factory(dict)
    generate_requests: int = 0
    retries_spent: int = 0
    tool_calls: int = 0
    tool_errors: collections.Counter[str] = attrs.Factory(collections.Counter)
    invariant_violations: int = 0
    escaped_exceptions: int = 0
    unfinished_samples: int = 0
    leftover_processes: int = 0
    peak_rss_mib: float = 0.0  # this process: engine, embedded server and model together
    problems: list[str] = attrs.Factory(list)

    @property
    def failed_tool_calls(self) -> int:
        """Calls that ran and failed (not the model's unparsable or surplus calls)."""
        from engine.trace.summary import count_failed_calls

        return count_failed_calls(self.tool_errors)

    @property
    def tools_dead(self) -> bool:
        """Every tool call failed: the sandbox is not working, whatever else held."""
        return self.tool_calls > 0 and self.failed_tool_calls >= self.tool_calls

    @property
    def ok(self) -> bool:
        return not (self.invariant_violations or self.escaped_exceptions or self.unfinished_samples
                    or self.leftover_processes or self.tools_dead)

    def note(self, problem: str) -> None:
        if len(self.problems) < SHOWN:
            self.problems.append(problem)

    def to_json(self) -> dict[str, Any]:
        data = attrs.asdict(self)
        rate = round(self.samples / self.wall_seconds, 2) if self.wall_seconds else None
        data.update(ok=self.ok, samples_per_second=rate, tools_dead=self.tools_dead)
        return data

    def format(self) -> str:
        def counts(c: Any) -> str:
            return ", ".join(f"{k} {v}" for k, v in sorted(c.items(), key=lambda kv: -kv[1])) or "none"

        rate = self.samples / self.wall_seconds if self.wall_seconds else 0.0
        lines = [
            f"soak: {self.samples} samples, concurrency {self.concurrency}, faults {self.faults}",
            f"wall time        {self.wall_seconds:.1f} s ({rate:.1f} samples/s)",
            f"peak RSS         {self.peak_rss_mib:.0f} MiB (engine and embedded server, one process)",
            f"statuses         {counts(self.statuses)}",
            f"reasons          {counts(self.reasons)}",
            f"faults injected  {counts(self.faults_injected)} (of {self.generate_requests} /generate requests)",
            f"retries spent    {self.retries_spent}",
            f"tool calls       {self.tool_calls} (errors: {counts(self.tool_errors)})",
            f"must be zero     invariant violations {self.invariant_violations}, escaped exceptions "
            f"{self.escaped_exceptions}, unfinished samples {self.unfinished_samples}, leftover processes "
            f"{self.leftover_processes}",
            *(f"  ! {p}" for p in self.problems),
            *([f"  ! every tool call failed ({self.failed_tool_calls} of {self.tool_calls}): the sandbox is not working"]
              if self.tools_dead else []),
            "OK" if self.ok else "FAILED",
        ]
        return "\n".join(lines)


class SampleChecker:
    """Re-derives I1-I4/I6 of finished samples: prompt ids rendered independently, budget, wire record."""

    def __init__(self, rt: Runtime, recorder: WireRecorder) -> None:
        self.tokenizer = rt.tokenizer
        self.budget = rt.cfg.max_context_len
        self.recorder = recorder
        self._prompts: dict[str, list[int]] = {}
        offered = rt.allowed_tools()  # the profile's default offer (retool withholds python_session)
        self._schemas = [tools.get(n).schema() for n in tools.names() if n in offered]  # type: ignore[union-attr]

    def prompt_ids(self, prompt: Any) -> list[int]:
        key = json.dumps(prompt, ensure_ascii=False)
        if key not in self._prompts:
            text = render_retool_prompt(prompt, self._schemas)
            self._prompts[key] = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return self._prompts[key]

    def violations(self, sample: Sample) -> list[str]:
        return sample_violations(
            sample.to_dict(), prompt_ids=self.prompt_ids(sample.prompt), budget=self.budget,
            decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False),
            sent=self.recorder.replies.get(str(sample.session_id), []),
        )


def engine_config(url: str, concurrency: int, stall_seconds: float) -> EngineConfig:
    """The engine's settings for a soak: the server's context, 8 turns, a timeout stalls outlast.

    At most IN_FLIGHT requests are sent at once (slime sizes its client the same way, with
    `--sglang-server-concurrency`); other samples wait for a connection in the client. The
    CPU server answers one request at a time, so more in flight would add only queueing
    latency, and the short request timeout is meant to catch stalls, not a queue the soak built.
    """
    return EngineConfig(
        server_url=url, max_turns=MAX_TURNS, max_tool_calls=MAX_TURNS, max_context_len=4096, tool_timeout=10.0,
        request_timeout=min(REQUEST_TIMEOUT, stall_seconds * 2 / 3), connect_timeout=REQUEST_TIMEOUT,
        max_connections=min(concurrency, IN_FLIGHT),
        retry=RetryPolicy(max_attempts=5, base_delay=0.1, max_delay=2.0, deadline=60.0),
    )


async def roll(result: SoakResult, cfg: EngineConfig, prompts: list[dict[str, Any]], seed: int,
               progress: bool) -> int:
    """Run every sample, check each as it finishes; returns the client's retries."""
    recorder = WireRecorder()
    http = make_http_client(cfg)
    http.add_event_hook("request", recorder.on_request)
    http.add_event_hook("response", recorder)
    rt = Runtime.create(cfg, http=http)
    checker = SampleChecker(rt, recorder)
    gate = asyncio.Semaphore(result.concurrency)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=result.samples, unit="sample", file=sys.stderr)

    async def one(i: int) -> None:
        row = prompts[i % len(prompts)]
        sample = Sample(index=i, prompt=row["prompt"], label=row.get("label"), session_id=f"soak-{seed}-{i}")
        async with gate:
            try:
                await run_sample(rt, sample, dict(PARAMS))
            except Exception as exc:  # the engine promises none: count, never stop the soak
                result.escaped_exceptions += 1
                result.note(f"sample {i}: {type(exc).__name__}: {exc}")
                return
            finally:
                if bar is not None:
                    bar.update(1)
        tally(result, sample, checker.violations(sample))

    try:
        await asyncio.gather(*(one(i) for i in range(result.samples)))
    finally:
        await rt.aclose()
        if bar is not None:
            bar.close()
    return rt.client.retries_spent


def tally(result: SoakResult, sample: Sample, problems: list[str]) -> None:
    """Count one finished sample into the result."""
    status = status_name(sample)
    metadata = engine_metadata(sample)
    result.statuses[status] += 1
    result.reasons[str(metadata.get("termination_reason"))] += 1
    stats = metadata.get("tool_stats") or {}
    result.tool_calls += int(stats.get("calls", 0))
    result.tool_errors.update(stats.get("errors") or {})
    if status == "PENDING":
        result.unfinished_samples += 1
        result.note(f"sample {sample.index} never reached a terminal state")
    if problems:
        result.invariant_violations += 1
        result.note(f"sample {sample.index} ({status} {metadata.get('termination_reason')}): {'; '.join(problems)}")


def run_soak(samples: int, concurrency: int, faults: str, seed: int, progress: bool = False) -> SoakResult:
    """Start the faulty server, roll `samples` out through it, and measure everything."""
    from engine.local.server import BackgroundServer, ServerSettings
    from engine.local.server.faults import FaultSpec

    spec = FaultSpec.parse(faults)
    spec = attrs.evolve(spec, seed=spec.seed + seed)  # another --seed, another fault sequence
    result = SoakResult(samples=samples, concurrency=concurrency, faults=spec.format())
    prompts = [json.loads(line) for line in open(demo_file("prompts.jsonl"), encoding="utf-8") if line.strip()]
    before = watched_processes()
    settings = ServerSettings(port=0, replay_path=demo_file("replay.jsonl"), faults=spec.format(), seed=seed)
    with BackgroundServer(settings) as server:
        cfg = engine_config(server.url, concurrency, spec.stall_seconds)
        started = time.perf_counter()
        result.retries_spent = asyncio.run(roll(result, cfg, prompts, seed, progress))
        result.wall_seconds = round(time.perf_counter() - started, 2)
        info = httpx.get(server.url + "/server_info", timeout=10, trust_env=False).json()
    result.faults_injected = dict(info.get("faults_injected") or {})
    result.generate_requests = int((info.get("embedded_stats") or {}).get("generate_requests", 0))
    left = {pid: desc for pid, desc in watched_processes().items() if pid not in before}
    result.leftover_processes = len(left)
    for desc in list(left.values())[:SHOWN]:
        result.note(f"leftover process: {desc}")
    result.peak_rss_mib = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return result


def main_soak(ns: argparse.Namespace) -> int:
    """`python -m engine soak`: see the module docstring. Exit 0 when every must-be-zero figure is 0."""
    from engine.local.server.faults import FaultSpec

    try:
        FaultSpec.parse(ns.faults)
    except ValueError as exc:
        print(f"error: --faults: {exc}", file=sys.stderr)
        return 2
    if ns.samples < 1 or ns.concurrency < 1:
        print("error: --samples and --concurrency must be at least 1", file=sys.stderr)
        return 2
    from engine.loop.preflight import check_tools_sync, describe

    problems = check_tools_sync(["code_interpreter"])  # the soak's calls go to the real sandbox
    if problems:
        print(f"error: {describe(problems)}; nothing was rolled out", file=sys.stderr)
        return 1
    progress = not ns.json and sys.stderr.isatty()
    result = run_soak(ns.samples, ns.concurrency, ns.faults, ns.seed, progress=progress)
    print(json.dumps(result.to_json(), indent=2, sort_keys=True) if ns.json else result.format())
    return 0 if result.ok else 1
